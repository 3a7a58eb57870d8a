"""`make demo`: pretrain a tiny TUPE-R BERT on the bundled corpus with what this machine has,
then show what it learned (tupe_ds/demo/report.py).

On GPUs: every GPU it finds (up to 8) in bf16 where they all have it, else fp16
(ds_configs/demo_bf16.json, demo_fp16.json); without one: 2 CPU processes in fp32 with ZeRO-2
(ds_configs/cpu_zero2.json). The deepspeed launcher starts tupe_ds.pretrain with the choice.
The tiny model's settings are TINY_MODEL_SETTINGS, on the corpus prepared with a vocabulary of
2,048 (Makefile); with the earlier ones (samples of 128 tokens, 16 a step, dropout 0.1, 1e-3, a
vocabulary of 8,192, 300 steps) it learned word frequencies and nothing else.
"""

from tupe_ds.tools import startup  # noqa: F401  (first: the collector paused while they import)
from tupe_ds.tools.third_party_warnings import add_verbose_flag  # filters import warnings
import logging
import os
import re
import subprocess
import sys

from tupe_ds.demo.report import report
from tupe_ds.distributed.launchers import launch
from tupe_ds.machine import doctor
from tupe_ds.tools import command_line, entry
from tupe_ds.tools.errors import Refused

logger = logging.getLogger(__name__)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_GPUS = 8
CPU_PROCESSES = 2
# What a 2-layer, 64-wide model needs to learn more than word frequencies in minutes (measured on
# 2 CPU ranks: bench/README.md, "make demo"; on GPUs not measured): short samples, many of them a
# step, no dropout, a high peak rate.
TINY_MODEL_SETTINGS = ("--seq-len", "64", "--global-batch", "32", "--dropout", "0", "--lr", "3e-3",
                       "--warmup-steps", "50")
# The training's own accuracy (every position chosen for masking) and TensorBoard command: the
# report says both after it, the accuracy at the [MASK] positions only, the command with its path.
VALID_ACCURACY = re.compile(r" valid/accuracy \S+")
TENSORBOARD_COMMAND = re.compile(r"^tensorboard --logdir ")


def demo_launch(machine: doctor.Machine) -> tuple:
    """(processes, DeepSpeed config, why) for this machine."""
    if machine.accelerator != "cuda" or machine.gpus == 0:
        return CPU_PROCESSES, doctor.CPU_CONFIG, "no GPU: 2 CPU processes, fp32"
    processes = min(machine.gpus, MAX_GPUS)
    half = machine.half_precision
    if half is None:  # GPUs older than doctor.FP16_CAPABILITY train in fp32
        return processes, doctor.CPU_CONFIG, f"{processes} GPU(s) without fp16 or bf16: fp32"
    return processes, f"ds_configs/demo_{half}.json", f"{processes} GPU(s), {half}"


def on_screen(line: str):
    """A line of the training's output as the demo shows it; None: not shown."""
    if TENSORBOARD_COMMAND.match(line):
        return None
    return VALID_ACCURACY.sub("", line)


def train(command: list) -> int:
    """Runs the training, its output on stdout filtered through on_screen; its exit code."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as process:
        for line in process.stdout:
            line = on_screen(line)
            if line is not None:
                print(line, end="", flush=True)
    return process.returncode


def main(argv=None) -> int:
    return entry.run("demo", lambda: demo(argv), errors=(Refused,))


def demo(argv) -> int:
    """The demo's work: the tiny model trained (train), then its report; train's exit code."""
    p = command_line.Parser(prog="python -m tupe_ds.demo.run",
                                description=__doc__.split("\n")[0], allow_abbrev=False)
    add_verbose_flag(p)
    command_line.add_config_flags(p)
    p.add_argument("--data", default="build/sample-prep-2048")
    p.add_argument("--out", default="build/demo-run")
    p.add_argument("--steps", type=int, default=2500)
    command_line.paths(p, "out", blend=["data"])
    args = command_line.parse(p, argv)
    processes, config, why = demo_launch(doctor.probe())
    logger.info(f"demo: {why} ({config})")
    code = launch("deepspeed", processes, "tupe_ds.pretrain", [
        "--data", args.data, "--model", "tiny", "--pos-encoding", "tupe-r", "--ds-config",
        os.path.join(ROOT, config), "--out", args.out, "--steps", str(args.steps),
        *TINY_MODEL_SETTINGS, "--eval-interval", "250", "--save-interval", "500",
        "--image-interval", "500", "--log-interval", "100",
        "--allow-training-changes"], train)  # DEMO_STEPS trains on: its decay moves, said
    if code == 0:  # report's Refused: its data's index cache, as tupe-pretrain checks it
        logger.info(report(args.out, args.data))
    return code


if __name__ == "__main__":
    sys.exit(main())
