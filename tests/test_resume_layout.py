"""Resuming on a different layout (tupe_ds/train/checkpoint/reshard.py): a checkpoint written at
dp=2 (ZeRO-1 and ZeRO-2) resumes at dp=1, at dp=4 and with another micro-batch x accumulation
split, and a tp=2 checkpoint at tp=1; the losses after the change equal those of the
uninterrupted run (fp32, dropout off: no layout changes the objective, as
test_loss_normalization.py shows), which needs the data position, Adam's moments and step and the
schedule to carry over. (Layouts that cannot be reshaped: test_run_config.py.)"""

import json
import os

import pytest

from runs import cut_back_to, log, train

STEPS = ["--steps", "6", "--save-interval", "3", "--eval-interval", "6", "--keep-checkpoints",
         "5", "--dropout", "0", "--global-batch", "32", "--lr", "2e-3", "--warmup-steps", "2"]
METRICS = ("train/loss", "train/lr", "train/grad_norm")


def assert_same_steps(resumed, reference, steps=(4, 5, 6), names=METRICS):
    after, before = log(resumed), log(reference)
    for step in steps:
        for name in names:
            assert after[step][name] == pytest.approx(before[step][name], rel=1e-5, abs=1e-6), (
                step, name)


def conversion_lines(stdout):
    return [line for line in stdout.splitlines() if "universal checkpoint" in line]


@pytest.fixture(scope="module", params=[1, 2], ids=["zero1", "zero2"])
def dp2_run(request, data, tmp_path_factory):
    """6 steps at dp=2 (micro-batch 8 x 2 accumulation), checkpoints at steps 3 and 6."""
    out = tmp_path_factory.mktemp(f"dp2-zero{request.param}") / "run"
    train("torchrun", 2, data, out, *STEPS, "--zero-stage", str(request.param))
    return request.param, out


def resume(dp2_run, data, copy, processes, *flags):
    stage, whole = dp2_run
    resumed = cut_back_to(whole, copy, 3)
    # one rank as one process without a launcher (as typed; test_pretrain.py): no test here is
    # about launchers, and each is a process start of its own
    stdout = train("torchrun" if processes > 1 else None, processes, data, resumed, *STEPS,
                   "--zero-stage", str(stage), *flags)
    assert "resumed at step 3 of 6" in stdout
    return resumed, stdout


@pytest.mark.slow
def test_a_dp2_checkpoint_resumes_on_one_rank(dp2_run, data, tmp_path):
    """Micro-batches of 8 (8 x 4 at dp=1): the uninterrupted dp=2 run is also the uninterrupted
    run of the new layout."""
    resumed, stdout = resume(dp2_run, data, tmp_path / "dp1", 1)
    converted = conversion_lines(stdout)
    assert len(converted) == 1 and "written by 2 processes (tp 1, pp 1, dp 2" in converted[0]
    assert "converted for 1 process " in converted[0]
    assert_same_steps(resumed, dp2_run[1])
    assert log(resumed)[6]["valid/loss"] == pytest.approx(log(dp2_run[1])[6]["valid/loss"],
                                                          rel=1e-5)
    assert os.listdir(resumed / "checkpoints" / "universal") == []  # dropped after step 6
    layout = json.loads((resumed / "checkpoints" / "step6" / "layout.json").read_text())
    assert (layout["dp"], layout["micro_batch"], layout["gradient_accumulation"]) == (1, 8, 4)


@pytest.mark.slow
def test_a_dp2_checkpoint_resumes_on_four_ranks_and_another_micro_batch_split(dp2_run, data,
                                                                              tmp_path):
    """At dp=4 in micro-batches of 4 (4 x 2 instead of 8 x 2) the checkpoint goes through the
    conversion, and the steps after it are the uninterrupted dp=2 run's: the loss is normalised
    per token, so another split of the global batch trains the same objective."""
    converted, stdout = resume(dp2_run, data, tmp_path / "dp4", 4, "--micro-batch", "4")
    lines = conversion_lines(stdout)
    assert len(lines) == 1 and "converted for 4 processes" in lines[0]
    layout = json.loads((converted / "checkpoints" / "step6" / "layout.json").read_text())
    assert (layout["dp"], layout["micro_batch"], layout["gradient_accumulation"]) == (4, 4, 2)
    assert_same_steps(converted, dp2_run[1])


@pytest.mark.slow
def test_a_tp2_checkpoint_resumes_at_tp1(data, tmp_path):
    whole = tmp_path / "tp2"
    train("torchrun", 2, data, whole, *STEPS, "--tp", "2", "--micro-batch", "8")
    resumed = cut_back_to(whole, tmp_path / "tp1", 3)
    # 4 x 8, was 8 x 4; --tp given anew, as the run's recorded --tp 2 would be taken
    stdout = train(None, 1, data, resumed, *STEPS, "--tp", "1", "--micro-batch", "4")
    assert "written by 2 processes (tp 2, pp 1, dp 1" in stdout
    assert "resumed at step 3 of 6" in stdout and "(tp 1, pp 1, dp 1)" in stdout
    assert_same_steps(resumed, whole)


def test_ranks_of_a_new_layout_derive_distinct_reproducible_random_states():
    """Data-parallel ranks and stages draw apart; tensor-parallel ranks share the default
    generator (hidden dropout of replicated activations) and not the tensor-parallel one."""
    import torch
    from megatron.core import tensor_parallel

    from tupe_ds.train.checkpoint.loading import derive_rng_state

    def draws(step, dp, pp, tp):
        derive_rng_state(1234, step, dp, pp, tp)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            heads = torch.rand(3)
        return tuple(torch.rand(3).tolist()), tuple(heads.tolist())

    ranks = [(dp, pp) for dp in range(3) for pp in range(2)]
    hidden = {rank: draws(300, *rank, tp=0)[0] for rank in ranks}
    assert len(set(hidden.values())) == len(ranks)
    assert draws(300, 2, 1, tp=0)[0] == hidden[(2, 1)]  # reproducible
    tp0, tp1 = draws(300, 1, 0, tp=0), draws(300, 1, 0, tp=1)
    assert tp0[0] == tp1[0] and tp0[1] != tp1[1]
    assert draws(301, 2, 1, tp=0)[0] != hidden[(2, 1)]
