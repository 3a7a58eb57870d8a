"""`make demo`: pretrain a tiny TUPE-R BERT on the bundled corpus with what this machine has.

On GPUs: every GPU it finds (up to 8) in bf16 where they all have it, else fp16
(ds_configs/demo_bf16.json, demo_fp16.json); without one: 2 CPU processes in fp32 with ZeRO-2
(ds_configs/cpu_zero2.json). The deepspeed launcher starts tupe_ds.pretrain with the choice.
"""

import argparse
import os
import subprocess
import sys

from tupe_ds import doctor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_GPUS = 8
CPU_PROCESSES = 2


def demo_launch(machine: doctor.Machine) -> tuple:
    """(processes, DeepSpeed config, why) for this machine."""
    if machine.accelerator != "cuda" or machine.gpus == 0:
        return CPU_PROCESSES, doctor.CPU_CONFIG, "no GPU: 2 CPU processes, fp32"
    processes = min(machine.gpus, MAX_GPUS)
    half = machine.half_precision
    if half is None:  # GPUs older than doctor.FP16_CAPABILITY train in fp32
        return processes, doctor.CPU_CONFIG, f"{processes} GPU(s) without fp16 or bf16: fp32"
    return processes, f"ds_configs/demo_{half}.json", f"{processes} GPU(s), {half}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tupe_ds.demo", description=__doc__.split("\n")[0])
    p.add_argument("--data", default="build/sample-prep")
    p.add_argument("--out", default="build/demo-run")
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args(argv)
    processes, config, why = demo_launch(doctor.probe())
    print(f"demo: {why} ({config})", flush=True)
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(processes),
               "--module", "tupe_ds.pretrain", "--data", args.data, "--model", "tiny",
               "--pos-encoding", "tupe-r", "--ds-config", os.path.join(ROOT, config),
               "--out", args.out, "--steps", str(args.steps), "--seq-len", "128",
               "--eval-interval", "100", "--save-interval", "100", "--image-interval", "100",
               "--log-interval", "20"]
    return subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main())
