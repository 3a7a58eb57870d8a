"""tests/support/exit_worker.py with faults injected, for test_run_integrity.py's fault matrix:

    TUPE_DS_FAULT="kill-after-file:zero_pp_rank_1_*:4"   SIGKILL to the whole run (every rank
        and the launcher: a node lost) once a checkpoint file matching the pattern is written in
        the save of step 4
    TUPE_DS_FAULT="kill-after-manifest:6" / "kill-after-latest:10" / "kill-during-deletion:8"
        the same after the manifest is written, after `latest` moves, or midway through
        retention's removal of an old checkpoint, in the save of that step
    TUPE_DS_FAULT="nan-loss:1:3,7" / "nan-grad:0:5"   the loss of rank 1 at steps 3 and 7, or
        one gradient element of rank 0 at step 5, made NaN
    TUPE_DS_FAULT="kill-mid-step:5"   the same in the middle of step 5 (after a forward pass)
    TUPE_DS_FAULT="usr1:1:5"   SIGUSR1 to rank 1 in the middle of step 5 (Slurm's preemption
        warning): the run saves at the end of the step and stops
    TUPE_DS_FAULT="disk-full:4"   every checkpoint file of the save of step 4 fails with ENOSPC,
        as on a full disk; "disk-full:4:1": rank 1's only; "disk-full:4:manifest": the manifest
        only (rank 0, after every rank wrote its files)
    TUPE_DS_FAULT="usr1-at-start:1"   SIGUSR1 to rank 1 as its engine is being built
    TUPE_DS_FAULT="stamp:PATH"   rank 0 appends "STEP START END" (time.time()) to PATH for each
        training step it runs: no fault, a clock outside the run
    TUPE_DS_FAULT="hold:5:PATH"   rank 0 writes PATH.waiting in the middle of step 5, then waits
        until PATH exists (the run stays alive while a test does something beside it)
    TUPE_DS_FAULT="stale-view:1:step12"   rank 1 does not see step12's manifest (as on a
        filesystem that shows another node's files late)
    TUPE_DS_FAULT="steal-lock:3"   at step 3 another job's record replaces OUT/run.lock (this run
        was presumed gone and taken over)
    TUPE_DS_FAULT="nan-weight:1:4"   one weight of rank 1 made NaN just before the save of step 4
    TUPE_DS_FAULT="node-local-locks"   file locks (the index cache's) are no-ops, as a lock that
        holds on one node only (NFS local_lock, BeeGFS, Lustre localflock) is across nodes
    TUPE_DS_FAULT="eio:0.5"   every open for reading of a file under OUT/checkpoints fails with
        EIO for 0.5 s from the first ("eio:inf": for the whole attempt), as a Lustre or NFS client
        answers for a while after a server hiccup

Several faults are separated by ';'. A kill, SIGUSR1, hold, full disk or EIO prints
"fault fired: FAULT" (its TUPE_DS_FAULT text) as it happens, so that a test tells a fault that
fired and went unreported from one that never fired.
"""

import command_start  # noqa: F401  (first: starts as a tupe_ds command)
import builtins
import errno
import fnmatch
import glob
import io
import os
import signal
import sys
import time
import types
import weakref

import torch

import exit_worker
from tupe_ds.train import loop
from tupe_ds.train.checkpoint import folder, manifest
from tupe_ds.train.steps import EngineSteps

ENGINE = {}


def kill_everything():
    """SIGKILL to the launcher and every rank (its children), as a lost node would see it. The
    launcher first: given a moment with a rank dead, it would report it and exit by itself."""
    sys.stdout.flush()
    launcher = os.getppid()
    ranks = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        pid = int(stat.split("/")[2])
        if parent == launcher and pid != os.getpid():
            ranks.append(pid)
    os.kill(launcher, signal.SIGKILL)
    for pid in ranks:
        os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def fired(fault: str) -> None:
    print(f"fault fired: {fault}", flush=True)


def hold_until(path: str, seconds: float = 300) -> None:
    if os.path.exists(path):
        return
    with open(path + ".waiting", "w"):
        pass
    deadline = time.monotonic() + seconds
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.1)


def step_in_progress() -> int:
    """The 1-based step being trained or saved (DeepSpeed counts finished optimizer steps)."""
    return ENGINE["engine"]().global_steps + (0 if ENGINE.get("saving") else 1)


def after(fault, module, name, condition):
    original = getattr(module, name)

    def wrapped(*args, **kwargs):
        result = original(*args, **kwargs)
        if condition(*args):
            fired(fault)
            kill_everything()
        return result

    setattr(module, name, wrapped)


def install(fault: str) -> None:
    kind, *rest = fault.split(":")
    if kind == "kill-after-file":
        pattern, step = rest[0], int(rest[1])
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import \
            TorchCheckpointEngine
        after(fault, TorchCheckpointEngine, "save", lambda self, state, path, *a: fnmatch.fnmatch(
            os.path.basename(path), pattern)
            and os.path.basename(os.path.dirname(path)) == f"step{step}")
    elif kind == "kill-after-manifest":
        after(fault, manifest, "write", lambda path, record: record["step"] == int(rest[0]))
    elif kind == "kill-after-latest":
        after(fault, folder, "point_latest", lambda directory, tag: tag == f"step{rest[0]}")
    elif kind == "kill-during-deletion":
        original = folder.remove_tree

        def remove_part_then_die(path):
            if ENGINE["engine"]().global_steps == int(rest[0]):
                os.remove(os.path.join(path, sorted(os.listdir(path))[0]))
                fired(fault)
                kill_everything()
            original(path)

        folder.remove_tree = remove_part_then_die
    elif kind in ("kill-mid-step", "usr1", "hold"):
        rank, step = (int(rest[0]), int(rest[1])) if kind == "usr1" else (0, int(rest[0]))
        if kind != "kill-mid-step" and int(os.environ.get("RANK", "0")) != rank:
            return
        forward = EngineSteps._forward

        def forward_then_fault(self, *args, **kwargs):
            result = forward(self, *args, **kwargs)
            if self.engine.training and step_in_progress() == step:
                fired(fault)
                if kind == "usr1":
                    os.kill(os.getpid(), signal.SIGUSR1)
                elif kind == "hold":
                    hold_until(rest[1])
                else:
                    kill_everything()
            return result

        EngineSteps._forward = forward_then_fault
    elif kind == "stamp":
        if int(os.environ.get("RANK", "0")) != 0:
            return
        train = EngineSteps.train

        def stamped_train(self, *args, **kwargs):
            started = time.time()
            result = train(self, *args, **kwargs)
            with open(rest[0], "a") as f:
                f.write(f"{step_in_progress() - 1} {started} {time.time()}\n")
            return result

        EngineSteps.train = stamped_train
    elif kind == "usr1-at-start":
        if int(os.environ.get("RANK", "0")) == int(rest[0]):
            ENGINE["usr1_at_start"] = True
    elif kind == "stale-view":
        if int(os.environ.get("RANK", "0")) != int(rest[0]):
            return
        digest = manifest.digest

        def unseen(step_dir):
            if os.path.basename(step_dir) == rest[1]:
                raise FileNotFoundError(os.path.join(step_dir, manifest.MANIFEST))
            return digest(step_dir)

        manifest.digest = unseen
    elif kind == "steal-lock":
        if int(os.environ.get("RANK", "0")) != 0:
            return
        forward = EngineSteps._forward

        def forward_then_steal(self, *args, **kwargs):
            if self.engine.training and step_in_progress() == int(rest[0]):
                out = sys.argv[sys.argv.index("--out") + 1]
                with open(os.path.join(out, "run.lock"), "w") as f:
                    f.write('{"token": "another job", "host": "elsewhere", "pid": 1}')
            return forward(self, *args, **kwargs)

        EngineSteps._forward = forward_then_steal
    elif kind == "disk-full":
        step, which = int(rest[0]), rest[1] if len(rest) > 1 else "every rank"

        def full(path):
            fired(fault)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

        if which == "manifest":
            write = manifest.write

            def write_or_full(folder_path, record):
                if record["step"] == step:
                    full(os.path.join(folder_path, manifest.MANIFEST))
                return write(folder_path, record)

            manifest.write = write_or_full
            return
        if which != "every rank" and int(os.environ.get("RANK", "0")) != int(which):
            return
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import \
            TorchCheckpointEngine
        save = TorchCheckpointEngine.save

        def save_or_full(self, state_dict, path, *args, **kwargs):
            if os.path.basename(os.path.dirname(path)) == f"step{step}":
                full(path)
            return save(self, state_dict, path, *args, **kwargs)

        TorchCheckpointEngine.save = save_or_full
    elif kind == "node-local-locks":
        from tupe_ds.tools import files

        files.fcntl = types.SimpleNamespace(flock=lambda handle, operation: None, LOCK_EX=0,
                                            LOCK_UN=0)
    elif kind == "nan-weight":
        if int(os.environ.get("RANK", "0")) == int(rest[0]):
            ENGINE["nan_weight_step"] = int(rest[1])
    elif kind in ("nan-loss", "nan-grad"):
        rank, steps = int(rest[0]), {int(s) for s in rest[1].split(",")}
        if int(os.environ.get("RANK", "0")) != rank:
            return
        if kind == "nan-loss":
            forward = EngineSteps._forward

            def nan_loss(self, batch, denominators):
                batch, loss, output = forward(self, batch, denominators)
                if self.engine.training and step_in_progress() in steps:
                    loss = loss * float("nan")
                return batch, loss, output

            EngineSteps._forward = nan_loss
        else:
            ENGINE["nan_grad_steps"] = steps
    elif kind == "eio":
        fail_reads(fault, float(rest[0]))
    else:
        raise SystemExit(f"unknown fault {fault!r}")


def fail_reads(fault: str, seconds: float) -> None:
    """Every open for reading of a file under OUT/checkpoints raises EIO, from the first such
    open for `seconds`. builtins.open and io.open are the one function every read of a checkpoint
    starts with (manifest, checksum, torch.load's, zipfile's), so that both are replaced."""
    out = sys.argv[sys.argv.index("--out") + 1]
    checkpoints = os.path.join(os.path.abspath(out), "checkpoints") + os.sep
    original, failing_until = builtins.open, []

    def open_or_fail(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)) and not set(mode) & set("wax+") and \
                os.path.abspath(os.fsdecode(file)).startswith(checkpoints):
            if not failing_until:
                failing_until.append(time.monotonic() + seconds)
                fired(fault)
            if time.monotonic() < failing_until[0]:
                raise OSError(errno.EIO, os.strerror(errno.EIO), os.fsdecode(file))
        return original(file, mode, *args, **kwargs)

    builtins.open = io.open = open_or_fail


def capture_engine():
    """The engine the run builds, for the faults that need its step; NaN into one gradient
    through a hook on the first parameter."""
    build = loop.build_engine

    def build_and_keep(*args, **kwargs):
        if ENGINE.get("usr1_at_start"):
            os.kill(os.getpid(), signal.SIGUSR1)
        model, engine, steps = build(*args, **kwargs)
        ENGINE["engine"] = weakref.ref(engine)  # the run lets it go at its end
        nan_steps = ENGINE.get("nan_grad_steps")
        if not nan_steps:
            return model, engine, steps

        def poison(grad):
            if step_in_progress() in nan_steps:
                grad = grad.clone()
                grad.view(-1)[0] = float("nan")
            return grad

        next(p for p in engine.module.parameters() if p.requires_grad).register_hook(poison)
        return model, engine, steps

    loop.build_engine = build_and_keep
    save = loop.save

    def saving(engine, *args, **kwargs):
        if engine.global_steps == ENGINE.get("nan_weight_step"):
            with torch.no_grad():
                next(engine.module.parameters()).view(-1)[0] = float("nan")
        ENGINE["saving"] = True
        try:
            return save(engine, *args, **kwargs)
        finally:
            ENGINE["saving"] = False

    loop.save = saving


if __name__ == "__main__":
    for fault in filter(None, os.environ.get("TUPE_DS_FAULT", "").split(";")):
        install(fault)
    capture_engine()
    torch.set_num_threads(1)
    sys.exit(exit_worker.main())
