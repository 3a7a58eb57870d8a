"""Saving a checkpoint: every rank's files, their checksums, the manifest, `latest`, retention.

The phases, in order (a kill in any of them leaves the previous complete checkpoint the newest
one): a folder already at stepN is set aside; the weights are checked finite on every rank;
DeepSpeed's files and each rank's random state are written; each rank flushes the files it wrote
to disk (fsync: the files, then their folder) and checksums them; rank 0 waits until every file
is visible, flushes the checkpoints folder (stepN's name), writes the manifest (flushed too),
points `latest` at it and applies retention: nothing is deleted before the checkpoint that
replaces it would survive a crash of the node. Before each of these three, rank 0 checks that
the run still holds its folder (`lock`, RunLock.stop_unless_held): a run another job took over
during its save stops there, leaving the new holder's manifests, `latest` and checkpoints as
they are.
"""

import contextlib
import dataclasses
import os
import time
from typing import List

import torch
import torch.distributed as dist

from tupe_ds.tools.files import make_durable, sync_folder, write_atomically
from tupe_ds.train.checkpoint import folder as folders
from tupe_ds.train.checkpoint import history, manifest, reshard
from tupe_ds.train.checkpoint.rng import file_name, rng_state
from tupe_ds.train.run_lock import FolderTakenOver
from tupe_ds.train.waits import announced

VISIBLE_WITHIN_SECONDS = 120  # a shared filesystem shows another node's new files within this


class NonFiniteWeights(RuntimeError):
    """The model holds a value that is not finite: nothing is saved."""


@contextlib.contextmanager
def recorded_writes(engine, written: List[str]):
    """Appends to `written` the path of every file DeepSpeed's checkpoint engine saves in the
    block (the engine's, ZeRO's and the pipeline's files all go through it)."""
    checkpoint_engine = engine.checkpoint_engine
    original = checkpoint_engine.save

    def save(state_dict, path, *args, **kwargs):
        result = original(state_dict, path, *args, **kwargs)
        written.append(path)
        return result

    checkpoint_engine.save = save
    try:
        yield
    finally:
        del checkpoint_engine.save  # the class's method again


def weights_are_finite(engine, device) -> bool:
    """Collective: whether the weights every rank holds are all finite: its parameters, or under
    ZeRO-3, where a parameter is an empty placeholder between uses, its shard of each."""

    def held(param):
        shard = getattr(param, "ds_tensor", None)  # ZeRO-3's partition of the parameter
        if shard is None:
            return param
        start = shard.numel() * dist.get_rank(group=param.ds_process_group)
        return shard[:max(0, param.ds_numel - start)]  # not the padding, left uninitialised

    checks = [torch.isfinite(held(p)).all() for p in engine.module.parameters()]
    flag = (torch.stack(checks).all() if checks else torch.tensor(True)).float().reshape(1)
    flag = flag.to(device)  # one synchronisation, not one per parameter
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


# What writing a checkpoint raises when it cannot: Python's file writes an OSError; torch.save's
# C++ writer a RuntimeError on a full disk ("PytorchStreamWriter failed writing file", "unexpected
# pos"); DeepSpeed's barrier a RuntimeError when another rank stopped writing ("Connection closed
# by peer")
WRITE_ERRORS = (OSError, RuntimeError)


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


class SaveFailed(RuntimeError):
    """A checkpoint could not be written or committed (a full disk, a folder in the way): the
    previous complete checkpoint stands. `everywhere`: every rank raised it (agreed in a
    collective); else only the ranks whose own writes failed, while the others wait in
    DeepSpeed's barrier."""

    def __init__(self, message: str, everywhere: bool):
        super().__init__(message)
        self.everywhere = everywhere


def save(engine, directory: str, step: int, client_state: dict, keep: int,
         layout: reshard.SavedLayout, record: dict, device, lock=None) -> None:
    """Collective: every rank calls it. `record` (lineage, identity) and `layout` go into the
    manifest; NonFiniteWeights, with nothing written, when a weight is not finite; SaveFailed
    when a file cannot be written (rank 0's own steps, setting aside and committing, are agreed
    by every rank: all raise it). `lock`: rank 0's OUT/run.lock."""
    tag, rank = folders.tag_of(step), dist.get_rank()
    folder = os.path.join(directory, tag)
    with announced(f"every rank to check its weights before checkpoint {tag}", rank):
        finite = weights_are_finite(engine, device)
    if not finite:
        raise NonFiniteWeights(f"the weights at step {step} are not all finite: checkpoint {tag} "
                               "was not written")

    def recorded(*new):  # rank 0: in the run's history, durable, before what it records
        out = os.path.dirname(os.path.normpath(directory))
        history.append(out, history.read(out) or [], list(new))

    def set_aside_in_the_way():
        os.makedirs(directory, exist_ok=True)
        in_the_way = os.path.join(directory, tag)
        if manifest.exists(in_the_way):
            try:
                recorded(history.record("set_aside", step=step, why="in the way of a save",
                                        id=history.checkpoint_id(manifest.read(in_the_way))))
            except ValueError:  # a damaged manifest: a folder of no checkpoint the history has
                pass
        said = folders.set_aside(directory, [step], "an earlier save of this step, in the way")
        if said:
            print(said, flush=True)

    # nothing is written before the old folder is out of the way
    on_rank_0(set_aside_in_the_way, f"could not write checkpoint {tag}", rank,
              f"rank 0 to set aside what is in the way of checkpoint {tag}")
    written = []
    try:
        with announced(f"every rank to write checkpoint {tag}", rank):  # DeepSpeed's barriers
            with recorded_writes(engine, written):
                engine.save_checkpoint(directory, tag=tag, client_state=client_state,
                                       save_latest=False)
            rng_path = os.path.join(folder, file_name(rank))
            torch.save(rng_state(), rng_path)
            written.append(rng_path)
            if rank == 0:
                layout_path = os.path.join(folder, reshard.LAYOUT_FILE)
                write_atomically(layout_path, layout.to_json())
                written.append(layout_path)
            make_durable(written)  # before the gather: rank 0 writes the manifest after it
            files = manifest.describe(folder, sorted({os.path.basename(p) for p in written}))
    except WRITE_ERRORS as error:
        raise SaveFailed(f"could not write checkpoint {tag} (rank {rank}: {first_line(error)})",
                         everywhere=False) from None
    every_rank = [None] * dist.get_world_size()
    with announced(f"every rank to checksum its files of checkpoint {tag}", rank):
        dist.all_gather_object(every_rank, files)

    def stop_unless_held():
        if lock is not None:
            lock.stop_unless_held()

    def commit():
        every_file = {name: entry for entries in every_rank for name, entry in entries.items()}
        wait_until_visible(folder, list(every_file))
        # a file written some other way than through DeepSpeed's checkpoint engine, by any rank
        unlisted = sorted(set(os.listdir(folder)) - set(every_file))
        make_durable(os.path.join(folder, name) for name in unlisted)
        every_file.update(manifest.describe(folder, unlisted))
        sync_folder(directory)  # stepN's own name (every rank flushed the names in it)
        stop_unless_held()
        identity = history.new_id()
        manifest.write(folder, {"tag": tag, "step": step, "id": identity, "files": every_file,
                                "layout": dataclasses.asdict(layout), **record})
        recorded(history.record("committed", id=identity, step=step,
                                lineage=record["lineage"], files=every_file))
        stop_unless_held()
        folders.point_latest(directory, tag)
        stop_unless_held()
        folders.retire(directory, step, record["lineage"], keep, lambda manifests: recorded(*(
            history.record("retired", id=history.checkpoint_id(m), step=m["step"])
            for m in manifests)))
        reshard.remove_conversions_before(directory, step)

    on_rank_0(commit, f"could not commit checkpoint {tag}", rank,
              f"rank 0 to commit checkpoint {tag} and remove older ones")


def on_rank_0(work, failure: str, rank: int, waiting_for: str) -> None:
    """Collective: rank 0 does `work` while the others wait; SaveFailed on every rank when it
    failed (an OSError: a full disk, a folder in the way), so that all stop alike."""
    problem = [None]
    if rank == 0:
        try:
            work()
        except FolderTakenOver:  # rank 0 stops alone, writing nothing more
            raise
        except WRITE_ERRORS as error:
            problem = [f"{failure} (rank 0: {first_line(error)})"]
    with announced(waiting_for, rank):
        dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise SaveFailed(problem[0], everywhere=True)


def wait_until_visible(folder: str, names: list) -> None:
    """Every rank has written its files (the gather); on a shared filesystem another node's new
    files may show here a little later. The manifest is written once all of them are seen."""
    deadline = time.monotonic() + VISIBLE_WITHIN_SECONDS
    while True:
        missing = [n for n in names if not os.path.exists(os.path.join(folder, n))]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{folder}: {', '.join(missing[:8])} not there "
                               f"{VISIBLE_WITHIN_SECONDS} s after every rank wrote its files; "
                               "is the checkpoint folder on a filesystem every node shares?")
        time.sleep(0.5)
