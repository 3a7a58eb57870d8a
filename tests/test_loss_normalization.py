"""One objective whatever the layout (tupe_ds/train/normalization.py).

Gradient invariance: the same global batches, whose micro-batches hold different numbers of
masked tokens, trained for 3 optimizer steps from the same weights under several (micro-batch,
accumulation, dp, tp, pp, ZeRO stage) layouts give the same parameters, for BERT's masked LM and
for ELECTRA (both terms, and the generator's samples drawn from the data stream), and the same
logged losses, gradient norms and validation metrics. BERT's batches ramp up
(--rampup-batch-size: 8 samples, then 16, so each layout's accumulation steps change between
steps), ELECTRA's are 8 each. The reference layout takes --micro-batch auto, whose probe
chooses 8 for it (micro_batch.py): the split auto chooses changes nothing either. Two
layouts compile (COMPILED): the compiled step gives the eager one's parameters too. The same
comparison on the mean-of-means path (--loss-normalization micro-batch) gives other parameters:
the negative control that shows the comparison can fail.
"""

import json
import os

import numpy as np
import pytest
import torch

from runs import ROOT, log, train
from tupe_ds.data.loader import Vocabulary
from tupe_ds.data.masking import MaskedSamples
from tupe_ds.data.packing import PackedSentences
from tupe_ds.export.consolidate import consolidated_state
from tupe_ds.train.objectives import OBJECTIVES

SEQ_LEN, STEPS = 64, 3
# objective: (global batch, its flags, the batch of each step, the seed: of the first 300 (400
# for mlm), the one whose micro-batches differ most, the premise below)
BATCHES = {"mlm": (16, ("--rampup-batch-size", "8", "8", "8"), (8, 16, 16), 355),
           "electra": (8, (), (8, 8, 8), 155)}
# name: (micro-batch, accumulation, dp, tp, pp, ZeRO stage); the first is the reference. Each
# parallel dimension once, beside accumulation: a second dp-and-accumulation layout (2x2-dp2)
# took a run of 2 ranks per objective and tested no path 1x4-dp2 does not.
LAYOUTS = {
    "8x1": (8, 1, 1, 1, 1, 2),
    "4x2": (4, 2, 1, 1, 1, 2),
    "1x4-dp2": (1, 4, 2, 1, 1, 2),
    "4x1-dp2-tp2": (4, 1, 2, 2, 1, 2),
    "4x2-pp2": (4, 2, 1, 1, 2, 1),  # the pipeline engine takes ZeRO stage 0 or 1
}
ELECTRA_LAYOUTS = [name for name, layout in LAYOUTS.items() if layout[4] == 1]  # no pipeline
# Layouts that also compile (--compile block; on a CPU the default is eager): the encoder as one
# region, both of ELECTRA's; a pipeline stage's layers one by one. The same parameters as the
# eager reference is the compiled training step's parity test, evaluation included; each says
# its graphs (rank 0's: the planned training and evaluation graph of each compiled part), so
# that a compile that fell back to eager could not pass for one.
COMPILED = {"4x2": {"mlm": 2, "electra": 4}, "4x2-pp2": {"mlm": 2}}
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}  # measured: at most 2e-6 apart; the control 1e-2


def constant_lr_config(tmp_path) -> str:
    """cpu_zero2.json without its schedule: every one of the 3 steps moves the weights."""
    with open(os.path.join(ROOT, "ds_configs", "cpu_zero2.json")) as f:
        config = json.load(f)
    del config["scheduler"]
    path = tmp_path / "constant_lr.json"
    path.write_text(json.dumps(config))
    return str(path)


def run_layout(data, out, objective, layout, config, *flags):
    """The run's consolidated parameters and its stdout; one process without a launcher (a
    launcher's start is 2 CPU seconds)."""
    micro, _, dp, tp, pp, zero_stage = layout
    global_batch, ramp, _, seed = BATCHES[objective]
    processes = dp * tp * pp
    output = train(
        "torchrun" if processes > 1 else None, processes, data, out, "--objective", objective,
        "--steps", str(STEPS), "--ds-config", config, "--global-batch", str(global_batch), *ramp,
        "--micro-batch", str(micro),
        "--tp", str(tp), "--pp", str(pp), "--zero-stage", str(zero_stage),
        "--dropout", "0", "--lr", "2e-3", "--seq-len", str(SEQ_LEN), "--seed", str(seed),
        "--eval-interval",
        str(STEPS), "--save-interval", str(STEPS), *flags)
    with open(out / "run.json") as f:
        run = json.load(f)
    return consolidated_state(run, str(out / "checkpoints" / f"step{STEPS}"))[1], output


def largest_difference(state, reference) -> float:
    return max((state[name] - tensor).abs().max().item() for name, tensor in reference.items())


def assert_micro_batches_differ(data, objective, layouts):
    """The test's premise: in every step, each layout's micro-batches, and its dp ranks' shares
    of the global batch (contiguous, data/loader.py's TrainBatches), hold numbers of the tokens
    its loss terms count that differ by 20% or more (a mean of means, or of the ranks' means,
    weighs their tokens differently)."""
    vocab = Vocabulary.from_data_dir(data)
    packed = PackedSentences(os.path.join(data, "train"), SEQ_LEN, vocab.cls, vocab.sep, data)
    samples = MaskedSamples(packed, vocab, OBJECTIVES[objective].default_masking,
                            BATCHES[objective][3])
    sizes = BATCHES[objective][2]
    for step, size in enumerate(sizes):
        batch = samples.global_samples(sum(sizes[:step]), size)
        rows = [OBJECTIVES[objective].token_counts({k: v[i:i + 1] for k, v in batch.items()})
                for i in range(size)]
        parts = {part for name in layouts for part in (LAYOUTS[name][0], size // LAYOUTS[name][2])}
        for part in sorted(part for part in parts if part < size):  # samples per micro-batch, rank
            counts = np.add.reduceat(np.array(rows), np.arange(0, size, part))
            assert np.all(counts.max(0) >= 1.2 * counts.min(0)), (step, part, counts)


@pytest.fixture(scope="module")
def constant_lr(tmp_path_factory):
    return constant_lr_config(tmp_path_factory.mktemp("config"))


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """One inductor cache (TORCHINDUCTOR_CACHE_DIR) for the module's compiled runs, where each
    would keep its own in its run folder (model/compiled.py; test_compile.py tests that one): a
    graph one run compiled another finds, as a requeued run does. ELECTRA's discriminator is
    BERT's tiny encoder at the same micro-batch: the graphs of mlm's compiled 4x2 (55 of 120 CPU
    seconds of ELECTRA's compiled run, 2-core CPU, 2026-12-02); the pipeline stage's layer finds
    its kernels among the encoder's. The parity is the same: a graph from the cache is the one
    the run would compile."""
    return tmp_path_factory.mktemp("compile-cache")


@pytest.mark.parametrize("objective,layouts", [("mlm", list(LAYOUTS)),
                                               ("electra", ELECTRA_LAYOUTS)])
@pytest.mark.slow
def test_every_layout_trains_the_same_parameters(data, tmp_path, constant_lr, compile_cache,
                                                 monkeypatch, objective, layouts):
    assert_micro_batches_differ(data, objective, layouts)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(compile_cache))
    reference, output = run_layout(data, tmp_path / layouts[0], objective, LAYOUTS[layouts[0]],
                                   constant_lr, "--micro-batch", "auto")
    assert "torch.compile" not in output  # eager, the CPU's default
    chosen = json.loads((tmp_path / layouts[0] / "run.json").read_text())["micro_batch"]
    assert chosen["size"] == chosen["auto"]["micro_batch"] == LAYOUTS[layouts[0]][0]
    logged = log(tmp_path / layouts[0])
    for name in layouts[1:]:
        compiled = ("--compile", "block") if name in COMPILED else ()
        state, output = run_layout(data, tmp_path / name, objective, LAYOUTS[name], constant_lr,
                                   *compiled)
        said = [line for line in output.splitlines() if "torch.compile" in line]
        print(objective, name, largest_difference(state, reference), *said)
        # the planned graphs compiled (no compile failed, running eager), or eager
        planned = [f"tupe-pretrain: torch.compile: {COMPILED[name][objective]} graphs"] \
            if compiled else []
        assert [line.split(" in ")[0] for line in said] == planned, said
        for parameter, expected in reference.items():
            torch.testing.assert_close(state[parameter], expected, **TOLERANCE,
                                       msg=f"{name}: {parameter}")
        assert [log(tmp_path / name)[s]["train/global_batch"] for s in range(1, STEPS + 1)] \
            == list(BATCHES[objective][2])
        for step, entry in log(tmp_path / name).items():  # what is logged too
            for metric, value in entry.items():
                if metric.startswith(("train/", "valid/")):
                    assert value == pytest.approx(logged[step][metric], rel=1e-5, abs=1e-6), (
                        name, step, metric)
    # The negative control: the mean of micro-batch means, at the layout furthest from one
    # micro-batch per step (and under dp, where that mode runs nowhere else), moves the
    # parameters by far more than the tolerance.
    control, _ = run_layout(data, tmp_path / "control", objective, LAYOUTS["1x4-dp2"],
                            constant_lr, "--loss-normalization", "micro-batch")
    print(objective, "control", largest_difference(control, reference))
    with pytest.raises(AssertionError):
        for parameter, expected in reference.items():
            torch.testing.assert_close(control[parameter], expected, **TOLERANCE)
