"""tupe-pretrain: masked-LM pretraining of a tupe_ds model with DeepSpeed.

    deepspeed --num_gpus 8 --module tupe_ds.pretrain --data prep/ --model bert-large \\
        --pos-encoding tupe-r --ds-config ds_configs/bert_large_fp16.json --out runs/large \\
        --steps 1000000
    torchrun --nproc_per_node 2 -m tupe_ds.pretrain ... (the same flags)
    srun python -m tupe_ds.pretrain ...  /  mpirun -np 8 python -m tupe_ds.pretrain ...
    deepspeed --num_gpus 8 --module tupe_ds.pretrain ... --pp 4   (pipeline, BERT; ZeRO 0 or 1)

Run again with the same --out (and a larger --steps to train on): it resumes from the newest
complete checkpoint, verified, data position included (tupe_ds/train/checkpoint/). SIGTERM or
SIGUSR1 saves a checkpoint and stops. Exit code 3: the run stopped itself (steps whose loss or
gradient was not finite, a checkpoint it could not write, a file of its run folder the filesystem
did not give for TUPE_DS_READ_RETRY_SECONDS, its log, TensorBoard events, data or tokenizer it
could not write or read, or its run folder taken over by another job), saying why and, for a
file, the newest intact checkpoint (tupe_ds/train/run_folder/files.py). Exit code 2: refused (the command, or what --out holds), saying what to change.
One job per --out: a second one is refused before any work (tupe_ds/train/run_folder/lock.py).
"""

from tupe_ds.tools import startup  # noqa: F401  (first: the collector paused while they import)
import tupe_ds.tools.third_party_warnings  # noqa: F401  (filters what others warn at import)
import logging
import os
import signal
import sys


def interrupted_while_starting(signum, frame):
    os.write(2, b"tupe-pretrain: SIGINT while starting: nothing was trained, there is nothing to "
                b"save; run the same command to continue\n")
    raise SystemExit(130)  # no traceback; pretrain()'s finally releases run.lock


def warned_while_starting(signum, frame):
    os.write(2, b"tupe-pretrain: SIGUSR1 while starting: nothing was trained, there is nothing to "
                b"save. SIGUSR1 is Slurm's warning before the time limit (or sent by hand): the "
                b"job is not requeued, as every attempt would stop the same way; raise sbatch's "
                b"--time above the warning's lead plus the start-up, then submit the same command "
                b"again\n")
    raise SystemExit(3)  # as stop_signal.before_first_step: slurm/srun_requeue.sh requeues 0


def listen_while_starting() -> None:
    signal.signal(signal.SIGINT, interrupted_while_starting)
    signal.signal(signal.SIGUSR1, warned_while_starting)  # its default action ends the process


if __name__ == "__main__":  # python -m: from before the imports below (StopSignal's in train())
    listen_while_starting()

from tupe_ds.distributed import launch
from tupe_ds.distributed.parallel import end_distributed
from tupe_ds.machine import doctor
from tupe_ds.tools import entry
from tupe_ds.tools.errors import Refused, TrainingStopped
from tupe_ds.train.checkpoint import resume, safe_load
from tupe_ds.train.config import load
from tupe_ds.train.loop import train
from tupe_ds.train.progress import processes

logger = logging.getLogger(__name__)


def main(argv=None) -> int:
    return entry.run("tupe-pretrain", lambda: pretrain(argv), errors=(Refused,))


def pretrain(argv) -> int:
    """Checks the run (load: a Refused, or an Unreadable run folder, every rank alike, before
    any process group), then trains it or, with --check-only, says what a start would do."""
    listen_while_starting()  # tupe-pretrain's entry point
    launcher = launch.discover()  # RANK, WORLD_SIZE, ... from deepspeed, torchrun, srun or mpirun
    safe_load.weights_only_everywhere()  # DeepSpeed's own loads included
    # everything checkable is checked before any process group starts; rank 0 holds OUT/run.lock
    run = load(argv, take_lock=first_rank())
    try:
        return run_or_check(run, launcher)
    finally:
        if run.lock is not None:
            run.lock.release()


def first_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"


def run_or_check(run, launcher: str) -> int:
    if run.check_only:
        machine = doctor.probe()
        findings = doctor.all_findings(machine, run.ds_config_path,
                                       launch.processes_on_this_node(), ds_config=run.ds_config)
        logger.info(doctor.report(machine, findings))
        auto = (" (auto: probed at the start, or kept from OUT/run.json when it resumes a "
                "checkpoint of the run on the same layout)" if run.batch_split.micro_batch is None
                else "")
        logger.info(f"tupe-pretrain: configuration OK for {processes(run.world_size)} "
                    f"({run.layout}), {run.batch_split}{auto}")
        for line in run.resume_plan.notes if run.resume_plan else ():
            logger.info(line)  # what a start would say: a consent spent, a checkpoint adopted
        for line in resume.what_is_where(run.out, run.resume_plan, run.init_plan):
            logger.info(f"tupe-pretrain: {line}")
        plan = run.resume_plan
        if plan and plan.candidates and plan.candidates[0] >= run.steps:
            where = "at" if plan.candidates[0] == run.steps else "past"
            logger.info(f"tupe-pretrain: {plan.tag} is {where} --steps {run.steps}: resuming it, "
                        "a run would train nothing and say the run's summary (a larger --steps "
                        "trains on)")
        return 0
    said, code = None, 0
    try:
        train(run, launcher)
    except Refused as refused:  # every rank alike, once the process group existed
        said, code = f"tupe-pretrain: error: {refused}", 2
    except TrainingStopped as stopped:  # reads.Unreadable among them
        said, code = f"tupe-pretrain: {stopped}", 3
        if not stopped.everywhere:  # the other ranks wait in a collective: none to end with them
            print(said, file=sys.stderr, flush=True)
            if run.lock is not None:
                run.lock.release()
            sys.stdout.flush()
            os._exit(3)  # before gloo's threads could abort the interpreter's exit
    # outside the except blocks: the exception's frames (the engine, its process groups) are gone
    if said and first_rank():
        print(said, file=sys.stderr, flush=True)
    end_distributed()  # after train() ended: its engine and model are garbage by now
    return code


if __name__ == "__main__":
    sys.exit(main())
