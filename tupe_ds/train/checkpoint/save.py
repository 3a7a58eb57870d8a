"""Saving a checkpoint, so that a kill anywhere leaves the previous one the newest complete: a
folder in the way set aside; the weights checked finite; every rank's files written, made durable
(fsync) and checksummed; then rank 0 waits until every file shows, writes the manifest (the commit
mark), records it in the history, points `latest` at it and applies retention. Before each of
these, rank 0 checks that the run still holds its folder (RunLock.stop_unless_held)."""

import contextlib
import dataclasses
import logging
import os
import time

import torch
import torch.distributed as dist

from tupe_ds.tools.errors import FolderTakenOver, HistoryDamaged, NonFiniteWeights, SaveFailed
from tupe_ds.tools.files import make_durable, sync_folder, write_atomically
from tupe_ds.train.checkpoint import folder as folders
from tupe_ds.train.checkpoint import history, manifest, reads, reshard, safe_load
from tupe_ds.train.checkpoint.loading import file_name, rng_state
from tupe_ds.tools.waits import announced

logger = logging.getLogger(__name__)

VISIBLE_WITHIN_SECONDS = 120  # a shared filesystem shows another node's new files within this
# What a failed write raises: Python's an OSError; torch.save's C++ writer a RuntimeError on a full
# disk; DeepSpeed's barrier a RuntimeError when another rank stopped ("Connection closed by peer")
WRITE_ERRORS = (OSError, RuntimeError)
HISTORY_REMEDY = ("Put back the run's history as it was last written (or move a damaged one "
                  "aside) and run the same command, which then says how to go on")


def saved_layout(run, engine) -> reshard.SavedLayout:
    return reshard.SavedLayout(
        world_size=run.world_size, tp=run.layout.tp, pp=run.layout.pp, dp=run.layout.dp,
        zero_stage=engine.zero_optimization_stage(),
        micro_batch=engine.train_micro_batch_size_per_gpu(),
        gradient_accumulation=engine.gradient_accumulation_steps(),
        vocab_size=run.models[0].vocab_size)


def checkpoint_record(run, lineage: str, plan=None) -> dict:
    """What the manifest of each checkpoint of this start records of the run."""
    return {"lineage": lineage, "identity": run.identity, "training": run.training,
            "settings": run.settings,  # the run's, for a history lost
            "resumed_from": plan.tag if plan else None,
            "init_from": run.init_plan.step_dir if run.init_plan else None,
            "software": safe_load.software_versions(),
            "lr_schedule": run.ds_config.get("scheduler")}  # its steps ran under: a --branch


@contextlib.contextmanager
def recorded_writes(engine, written: list):
    """Appends to `written` every file DeepSpeed's checkpoint engine saves in the block."""
    original = engine.checkpoint_engine.save

    def save(state_dict, path, *args, **kwargs):
        result = original(state_dict, path, *args, **kwargs)
        written.append(path)
        return result

    engine.checkpoint_engine.save = save
    try:
        yield
    finally:
        del engine.checkpoint_engine.save  # the class's method again


def weights_are_finite(engine, device) -> bool:
    """Collective: whether every rank's weights are finite (under ZeRO-3, its shard of each)."""

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


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def save(engine, directory: str, step: int, client_state: dict, keep: int,
         layout: reshard.SavedLayout, record: dict, device, lock=None) -> None:
    """Collective: checkpoint `step` (`record`, checkpoint_record, and `layout` go into its
    manifest). NonFiniteWeights with nothing written; SaveFailed when a file cannot be written
    (on every rank for rank 0's steps). `lock`: rank 0's OUT/run.lock."""
    tag, rank = folders.tag_of(step), dist.get_rank()
    folder, out = os.path.join(directory, tag), os.path.dirname(os.path.normpath(directory))
    with announced(f"every rank to check its weights before checkpoint {tag}", rank):
        if not weights_are_finite(engine, device):
            raise NonFiniteWeights(f"the weights at step {step} are not all finite: checkpoint "
                                   f"{tag} was not written")

    def recorded(*new):  # rank 0: in the history, durable, before what it records
        if not (records := history.read(out)):  # its start wrote one: a history lost meanwhile
            raise HistoryDamaged(f"{os.path.join(out, history.FILE)} is gone (or emptied) while "
                                 "the run trains")
        history.append(out, records, list(new))

    def set_aside_in_the_way():
        os.makedirs(directory, exist_ok=True)
        if manifest.exists(folder):
            with contextlib.suppress(ValueError):  # a damaged manifest: no checkpoint it records
                recorded(history.record("set_aside", step=step, why="in the way of a save",
                                        id=history.checkpoint_id(manifest.read(folder))))
        said = folders.set_aside(directory, [step], "an earlier save of this step, in the way")
        if said:
            logger.info(said)

    on_rank_0(set_aside_in_the_way, f"could not write checkpoint {tag}",
              f"rank 0 to set aside what is in the way of checkpoint {tag}")
    written = []
    try:
        with announced(f"every rank to write checkpoint {tag}", rank):  # DeepSpeed's barriers
            with recorded_writes(engine, written):
                engine.save_checkpoint(directory, tag=tag, client_state=client_state,
                                       save_latest=False)
            written.append(os.path.join(folder, file_name(rank)))
            torch.save(rng_state(), written[-1])
            if rank == 0:
                written.append(os.path.join(folder, reshard.LAYOUT_FILE))
                write_atomically(written[-1], layout.to_json())
            make_durable(written)  # before the gather: rank 0 writes the manifest after it
            files = manifest.describe(folder, sorted({os.path.basename(p) for p in written}))
    except WRITE_ERRORS as error:
        raise SaveFailed(f"could not write checkpoint {tag} (rank {rank}: {first_line(error)})",
                         everywhere=False) from None
    every_rank = reads.gathered(lambda: files,
                                f"every rank to checksum its files of checkpoint {tag}")

    still_held = lock.stop_unless_held if lock is not None else lambda: None

    def commit():
        every_file = {name: entry for entries in every_rank for name, entry in entries.items()}
        wait_until_visible(folder, list(every_file))
        # a file written some other way than through DeepSpeed's checkpoint engine, by any rank
        unlisted = sorted(set(os.listdir(folder)) - set(every_file))
        make_durable(os.path.join(folder, name) for name in unlisted)
        every_file.update(manifest.describe(folder, unlisted))
        sync_folder(directory)  # stepN's own name
        still_held()
        recorded()  # the history still there: no manifest of a checkpoint it cannot record
        identity = history.new_id()
        manifest.write(folder, {"tag": tag, "step": step, "id": identity, "files": every_file,
                                "layout": dataclasses.asdict(layout), **record})
        recorded(history.record("committed", id=identity, step=step,
                                lineage=record["lineage"], files=every_file))
        still_held()
        folders.point_latest(directory, tag)
        still_held()
        folders.retire(directory, step, record["lineage"], keep, lambda manifests: recorded(*(
            history.record("retired", id=history.checkpoint_id(m), step=m["step"])
            for m in manifests)))
        reshard.remove_conversions_before(directory, step)

    on_rank_0(commit, f"could not commit checkpoint {tag}",
              f"rank 0 to commit checkpoint {tag} and remove older ones")


def on_rank_0(work, failure: str, waiting_for: str) -> None:
    """Collective: rank 0 does `work` while the others wait; SaveFailed on every rank when it
    failed, so that all stop alike."""
    def attempt():
        if dist.get_rank() == 0:
            try:
                work()
            except FolderTakenOver:  # rank 0 stops alone, writing nothing more
                raise
            except (*WRITE_ERRORS, HistoryDamaged) as error:  # a history damaged meanwhile
                remedy = HISTORY_REMEDY if isinstance(error, HistoryDamaged) else ""
                return f"{failure} (rank 0: {first_line(error)})", remedy

    if problem := reads.gathered(attempt, waiting_for)[0]:
        raise SaveFailed(problem[0], everywhere=True, remedy=problem[1])


def wait_until_visible(folder: str, names: list) -> None:
    """Waits until every rank's files show here (a shared filesystem may show them late)."""
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
