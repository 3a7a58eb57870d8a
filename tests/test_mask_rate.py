"""--mask-rate and --mask-split: checked on the command line, the masks they make, and where a run
records them (its identity, run.json, the export's model card)."""

import dataclasses
import json
import os

import numpy as np
import pytest
import torch.distributed as dist

from tupe_ds.data.loader import Vocabulary
from tupe_ds.data.masking import IGNORE_INDEX, MaskingIds, MaskingScheme, mask_batch, mask_tokens
from tupe_ds.export.hf.convert import model_card, transformers_config
from tupe_ds.model.config import ModelConfig
from tupe_ds.train.checkpoint import same_run
from tupe_ds.train.config import load
from tupe_ds.train.datasets import datasets
from tupe_ds.train.flags import parser
from tupe_ds.train.masking_flags import masking_scheme
from tupe_ds.train.objectives import OBJECTIVES
from tupe_ds.train.run_folder.description import describe_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_CONFIG = os.path.join(ROOT, "ds_configs", "cpu_zero2.json")
REQUIRED = ["--data", "prep", "--ds-config", CPU_CONFIG, "--out", "run", "--steps", "1"]
CHANGED = MaskingScheme(probability=0.3, mask=0.7, random=0.2)
CHANGED_FLAGS = ["--mask-rate", "0.3", "--mask-split", "0.7,0.2"]


@pytest.mark.parametrize("flag, value, said", [
    ("--mask-rate", "0", "0: the share of tokens chosen must be above 0 and below 1"),
    ("--mask-rate", "1", "1: the share of tokens chosen must be above 0 and below 1"),
    ("--mask-rate", "nan", "nan: the share of tokens chosen must be above 0 and below 1"),
    ("--mask-rate", "a tenth", "invalid mask_rate value: 'a tenth'"),
    ("--mask-split", "0.9,0.2", "0.9,0.2: each share must be between 0 and 1 and the two add up "
                                "to at most 1"),
    ("--mask-split", "-0.1,0.5", "-0.1,0.5: each share must be between 0 and 1"),
    ("--mask-split", "0.8", "0.8: give two shares, M,R (BERT's are 0.8,0.1)"),
    ("--mask-split", "0.8,0.1,0.1", "0.8,0.1,0.1: give two shares, M,R"),
])
def test_a_rate_or_split_out_of_range_is_refused_naming_the_flag(flag, value, said, capsys):
    with pytest.raises(SystemExit):
        parser().parse_args([*REQUIRED, f"{flag}={value}"])  # "=": a value may start with -
    assert f"tupe-pretrain: error: argument {flag}: {said}" in capsys.readouterr().err


def test_the_defaults_are_the_masking_earlier_runs_trained_with_and_each_flag_sets_its_part():
    """The defaults keep the stream of earlier versions (BERT 15% 80/10/10, ELECTRA's generator
    15% 85/0/15): their checkpoints resume, and the losses of the reference runs hold."""
    bert, electra = OBJECTIVES["mlm"].default_masking, OBJECTIVES["electra"].default_masking
    assert bert == MaskingScheme(probability=0.15, mask=0.8, random=0.1)
    assert electra == MaskingScheme(probability=0.15, mask=0.85, random=0.0)
    assert masking_scheme(parser().parse_args(REQUIRED), bert) == bert
    assert masking_scheme(parser().parse_args([*REQUIRED, "--mask-rate", "0.2"]), electra) == \
        MaskingScheme(probability=0.2, mask=0.85, random=0.0)
    assert masking_scheme(parser().parse_args([*REQUIRED, "--mask-split", "1,0"]), bert) == \
        MaskingScheme(probability=0.15, mask=1.0, random=0.0)


def test_another_rate_and_split_mask_each_sample_alone_as_asked():
    """round(rate x candidates) tokens per row, made [MASK], random or kept in the split's
    shares, each row as its sample masked alone (a function of seed, epoch, sample, position)."""
    rng = np.random.default_rng(5)
    ids = MaskingIds(mask=4, random_low=7, random_high=1000)
    special = np.array([0, 2, 3])
    is_special = np.isin(np.arange(1500), special)
    rows, width = 200, 512
    tokens = rng.integers(1000, 1500, size=(rows, width))  # a random id never equals the token
    tokens[:, 0], tokens[:, -1] = 2, 3
    epochs, samples = np.zeros(rows, dtype=np.int64), np.arange(rows)
    inputs, labels = mask_batch(tokens, 1234, epochs, samples, CHANGED, ids, is_special)
    chosen = labels != IGNORE_INDEX
    assert np.all(chosen.sum(axis=1) == round(0.3 * (width - 2)))
    made_mask = (inputs == ids.mask)[chosen].mean()
    kept = (inputs == tokens)[chosen].mean()
    assert abs(made_mask - 0.7) < 0.01 and abs(kept - 0.1) < 0.01
    assert abs(1 - made_mask - kept - 0.2) < 0.01
    for row in range(0, rows, 37):
        alone = mask_tokens(tokens[row], 1234, 0, row, CHANGED, ids, special)
        assert np.array_equal(inputs[row], alone[0]) and np.array_equal(labels[row], alone[1])


def start(data, tmp_path, monkeypatch, *flags):
    monkeypatch.setenv("WORLD_SIZE", "1")
    return load(["--data", data, "--ds-config", CPU_CONFIG, "--out", str(tmp_path / "run"),
                 "--steps", "2", "--model", "tiny", "--seq-len", "64", *flags])


def test_a_run_streams_and_records_its_masking_and_a_resume_with_another_is_named(
        data, tmp_path, monkeypatch):
    """The run's data streams mask as the flags say; its identity and run.json record the
    scheme; a checkpoint's identity of another scheme differs in lines naming each flag and
    both values (what same_run.refuse_another_run says)."""
    run = start(data, tmp_path, monkeypatch, *CHANGED_FLAGS, "--objective", "electra")
    assert run.masking == CHANGED and run.identity["masking"] == dataclasses.asdict(CHANGED)
    started = not dist.is_initialized()  # datasets' collectives, in a one-process group
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        streams = datasets(run, Vocabulary.from_data_dir(data), OBJECTIVES[run.objective])
    finally:
        if started:
            dist.destroy_process_group()
    assert {samples.scheme for samples in [*streams["train"].sources, *streams["valid"]]} == \
        {CHANGED}
    os.makedirs(run.out)  # as train() does before it writes run.json
    describe_run(run, lineage="test")
    written = json.loads((tmp_path / "run" / "run.json").read_text())
    assert written["masking"] == {"probability": 0.3, "mask": 0.7, "random": 0.2}

    # another folder: in the same one, the run's recorded masking would be the default's
    default = start(data, tmp_path / "other", monkeypatch, "--objective", "electra")
    assert same_run.differences(default.identity, run.identity) == [
        "masking.mask: 0.85 in the checkpoint, 0.7 now (--mask-split)",
        "masking.probability: 0.15 in the checkpoint, 0.3 now (--mask-rate)",
        "masking.random: 0.0 in the checkpoint, 0.2 now (--mask-split)"]


@pytest.mark.parametrize("kind, inputs", [("bert-mlm", "Its inputs"),
                                          ("electra-discriminator", "The generator's inputs")])
def test_the_model_card_says_how_the_inputs_were_masked(kind, inputs):
    config = ModelConfig.from_preset("tiny", vocab_size=1024)
    description = transformers_config(dataclasses.asdict(config),
                                      dataclasses.asdict(config.encoding), kind,
                                      config.hidden_size, "RUN/checkpoints/step2", 1000)
    card = " ".join(model_card(description, dataclasses.asdict(CHANGED)).split())
    assert (f"- **Masking.** {inputs} were masked as `tupe-pretrain --mask-rate 0.3 --mask-split "
            "0.7,0.2` does: 30% of each sample's tokens chosen for the loss, 70% of them made "
            "`[MASK]`, 20% a random token and 10% left as they were.") in card
    assert "Masking" not in model_card(description)  # a checkpoint that records none
