"""The run's datasets: each --data source's packed samples, opened by global rank 0 first, masked
into a stream; the training stream their blend, this rank's batches of it, and which ranks read
batches at all."""

import os
from typing import Optional

import torch.distributed as dist
from megatron.core import parallel_state

from tupe_ds.data.blend import BlendedSamples
from tupe_ds.data.loader import TrainBatches, Vocabulary
from tupe_ds.data.masking import MaskedSamples
from tupe_ds.data.packing import PackedSentences
from tupe_ds.train.batch_ramp import BatchRamp
from tupe_ds.train.config import RunConfig
from tupe_ds.train.run_folder import files as folder_files
from tupe_ds.tools.waits import announced


def datasets(run: RunConfig, vocab: Vocabulary, objective, newest: Optional[str] = None) -> dict:
    """"train": the stream of --data (the blend of its sources; one source is its own stream),
    "valid": each source's valid samples, in --data's order. Global rank 0 opens the datasets
    first, building the sample indexes that are missing, while the other ranks wait at a
    barrier, then map them: the index cache's file lock alone would let every node build at once
    on a filesystem whose locks hold per node (NFS with local_lock, BeeGFS, Lustre's
    localflock). A file that cannot be read or written (a read error, a full disk) on any rank
    stops every rank (run_folder/files.py; `newest`: the newest intact checkpoint's tag)."""
    def open_sources():
        return [{split: PackedSentences(os.path.join(source.folder, split), run.seq_len,
                                        vocab.cls, vocab.sep, source.index_cache)
                 for split in ("train", "valid")} for source in run.sources]

    def stream(packed):
        return MaskedSamples(packed, vocab, run.masking, run.seed, run.vectorised_stream,
                             objective.generator_draws)

    first, folders = dist.get_rank() == 0, ", ".join(source.folder for source in run.sources)
    packed = folder_files.on_every_rank(open_sources if first else lambda: None, "open the data",
                                        folders, newest, "rank 0 to open the data")
    packed = folder_files.on_every_rank(lambda: packed or open_sources(), "open the data",
                                        folders, newest, "every rank to open the data")
    return {"train": BlendedSamples([stream(p["train"]) for p in packed],
                                    [source.weight for source in run.sources]),
            "valid": [stream(p["valid"]) for p in packed]}


def reads_data(run: RunConfig) -> bool:
    """Whether this rank's steps read batches (a pipeline's middle stages do not)."""
    return run.layout.pp == 1 or parallel_state.is_pipeline_first_stage() \
        or parallel_state.is_pipeline_last_stage()


def open_datasets(run: RunConfig, objective, rank: int, newest: Optional[str]) -> dict:
    """datasets(), saying what it waits for while the sample indexes are built; a tokenizer or
    data that cannot be read stops every rank (run_folder/files.py)."""
    vocab = folder_files.on_every_rank(lambda: Vocabulary.from_data_dir(run.data), "read",
                                    os.path.join(run.data, "tokenizer.json"), newest,
                                    "every rank to read the tokenizer")
    folders = ", ".join(source.folder for source in run.sources)
    with announced(f"the sample indexes of {folders} (seq-len {run.seq_len})", rank):
        return datasets(run, vocab, objective, newest)


def train_batches(run: RunConfig, train: BlendedSamples, engine, state: Optional[dict],
                  device) -> TrainBatches:
    """This rank's batches of the training stream, from the sample the resumed `state` reached
    (None: the first), in batches that grow as --rampup-batch-size says."""
    micro_batch = engine.train_micro_batch_size_per_gpu()
    ramp = run.batch_split.ramp
    return TrainBatches(train, micro_batch, engine.gradient_accumulation_steps(),
                        parallel_state.get_data_parallel_rank(), run.layout.dp,
                        consumed=state["consumed"] if state else 0,
                        prefetch=run.prefetch if reads_data(run) else 0,
                        pin=device.type != "cpu",
                        ramp=BatchRamp(ramp, run.batch_split.global_batch, micro_batch,
                                       run.layout.dp) if ramp else None,
                        tokens_seen=state.get("tokens_seen") if state else 0)
