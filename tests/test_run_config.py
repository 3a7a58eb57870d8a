"""tupe-pretrain's configuration is checked before any process group starts; errors say what to change."""

import json
import os

import pytest

from tupe_ds.tools.errors import Refused
from tupe_ds.train import config
from tupe_ds.train.checkpoint import history, manifest
from tupe_ds.train.config import load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_CONFIG = os.path.join(ROOT, "ds_configs", "cpu_zero2.json")


def fails(argv, monkeypatch, world=2):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(Refused) as error:
        load(argv)
    return str(error.value)


def base(data_dir, tmp_path, *extra, **options):
    """The flags of a valid tiny run, with `options` ({"model": "bert-large"}) replacing some."""
    flags = {"data": data_dir, "ds-config": CPU_CONFIG, "out": str(tmp_path / "run"), "steps": "10",
             "model": "tiny", "seq-len": "64"}
    flags.update({key.replace("_", "-"): value for key, value in options.items()})
    return [item for key, value in flags.items() for item in (f"--{key}", value)] + list(extra)


def test_errors_name_what_to_change(data, tmp_path, monkeypatch):
    assert "--tp 2 does not divide the 3 processes" in fails(base(data, tmp_path, "--tp", "2"),
                                                             monkeypatch, world=3)
    assert "not a multiple of micro-batch 8 x 2 data-parallel ranks" in fails(
        base(data, tmp_path, "--global-batch", "24"), monkeypatch)
    assert "--objective electra needs --model electra-base or tiny, not 'bert-large'" in fails(
        base(data, tmp_path, "--objective", "electra", model="bert-large"), monkeypatch)
    assert "is an ELECTRA pair: add --objective electra" in fails(
        base(data, tmp_path, model="electra-base"), monkeypatch)
    assert f"--data {tmp_path}: no train.idx" in fails(base(data, tmp_path, data=str(tmp_path)),
                                                       monkeypatch)
    broken = tmp_path / "broken.json"
    broken.write_text('{"train_batch_size": 16,\n oops}')
    assert "invalid JSON at line 2" in fails(base(data, tmp_path, ds_config=str(broken)), monkeypatch)
    (tmp_path / "latin1.json").write_bytes(b'{"optimizer": "\xe9"}')
    (tmp_path / "list.json").write_text("[]")
    (tmp_path / "string.json").write_text('{"train_batch_size": 16, "optimizer": "AdamW"}')
    (tmp_path / "params.json").write_text('{"scheduler": {"type": "WarmupLR", "params": [1]}}')
    (tmp_path / "nan.json").write_text('{"optimizer": {"params": {"betas": [0.9, NaN]}}}')
    for name, problem in (("latin1.json", "not readable as a JSON file ('utf-8' codec"),
                          ("list.json", "a DeepSpeed config is a JSON object ({...}), not []"),
                          ("string.json", "\"optimizer\" is \"AdamW\", not an object"),
                          ("params.json", "\"scheduler.params\" is [1], not an object"),
                          ("nan.json", "\"optimizer.params.betas[1]\" is not a finite number"),
                          ("", "a folder, not a file: give a DeepSpeed config (JSON)")):
        assert f"--ds-config {tmp_path / name}: {problem}" in fails(
            base(data, tmp_path, ds_config=str(tmp_path / name)), monkeypatch)
    with open(CPU_CONFIG) as f:  # tupe-pretrain writes --steps into total_num_steps
        config = json.load(f)
    config["scheduler"]["params"].update(total_num_steps="auto", warmup_num_steps="20")
    (tmp_path / "steps.json").write_text(json.dumps(config))
    assert (f"{tmp_path / 'steps.json'}: the scheduler's warmup_num_steps is \"20\", not a whole "
            "number of steps; give one there, or --warmup-steps N") in fails(
        base(data, tmp_path, ds_config=str(tmp_path / "steps.json")), monkeypatch)
    assert load(base(data, tmp_path, "--warmup-steps", "3", ds_config=str(tmp_path / "steps.json"),
                     out=str(tmp_path / "auto")) + ["--check-only"]).ds_config["scheduler"][
        "params"]["total_num_steps"] == 10
    for flags, said in ((("--lr", "nan"), "--lr nan: a learning rate is a positive, finite"),
                        (("--lr=-1",), "--lr -1.0: a learning rate"), (("--lr", "inf"), "--lr inf"),
                        (("--seed", str(2**64)), f"--seed {2**64}: give a whole number from 0"),
                        (("--seed", "-1"), "--seed -1: give"),
                        (("--dropout", "1.5"), "--dropout 1.5: a probability from 0 to below 1")):
        assert said in fails(base(data, tmp_path, *flags), monkeypatch)
    assert "ModelConfig.num_attention_heads" in fails(base(data, tmp_path, "--tp", "8"), monkeypatch,
                                                      world=8)
    assert "--compile block with ZeRO stage 3" in fails(
        base(data, tmp_path, "--compile", "block", "--zero-stage", "3"), monkeypatch)
    assert "'block' at tensor_parallel_size=2" in fails(
        base(data, tmp_path, "--compile", "block", "--tp", "2"), monkeypatch)
    assert not os.path.exists(tmp_path / "run")  # nothing was started or written


def test_pipeline_errors_name_what_to_change(data, tmp_path, monkeypatch):
    assert "--tp 2 x --pp 2 = 4 does not divide the 6 processes" in fails(
        base(data, tmp_path, "--tp", "2", "--pp", "2"), monkeypatch, world=6)
    assert ("DeepSpeed's pipeline engine supports ZeRO stage 0 or 1, and "
            f"{CPU_CONFIG} sets stage 2; use --zero-stage 1") in fails(
        base(data, tmp_path, "--pp", "2"), monkeypatch)
    assert "--zero-stage sets stage 3; use --zero-stage 1" in fails(
        base(data, tmp_path, "--pp", "2", "--zero-stage", "3"), monkeypatch)
    assert "leaves the later stages' replicated parameters out of the gradient norm" in fails(
        base(data, tmp_path, "--pp", "2", "--zero-stage", "0"), monkeypatch)
    assert "pipeline parallelism is for BERT (--objective mlm)" in fails(
        base(data, tmp_path, "--pp", "2", "--zero-stage", "1", "--objective", "electra"), monkeypatch)
    assert "--model tiny has 2 layers, and every pipeline stage needs at least one" in fails(
        base(data, tmp_path, "--pp", "4", "--zero-stage", "1"), monkeypatch, world=4)
    assert not os.path.exists(tmp_path / "run")


def test_pipeline_layout_sets_the_data_parallel_size(data, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    run = load(base(data, tmp_path, "--tp", "2", "--pp", "2", "--zero-stage", "1",
                    "--global-batch", "32", "--micro-batch", "4"))
    assert run.dp_size == 2
    assert run.ds_config["zero_optimization"]["stage"] == 1
    assert run.ds_config["gradient_accumulation_steps"] == 4


def test_overrides_and_derived_settings(data, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    run = load(base(data, tmp_path, "--global-batch", "32", "--micro-batch", "4", "--lr", "5e-4",
                    "--warmup-steps", "3"))
    config = run.ds_config
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"],
            config["gradient_accumulation_steps"]) == (32, 4, 4)
    scheduler = config["scheduler"]["params"]
    assert (scheduler["total_num_steps"], scheduler["warmup_num_steps"], scheduler["warmup_max_lr"]) == (
        10, 3, 5e-4)
    assert config["optimizer"]["params"]["lr"] == 5e-4
    with open(os.path.join(data, "manifest.json")) as f:
        vocab = json.load(f)["vocab_size"]
    assert run.models[0].vocab_size == -(-vocab // 128) * 128
    assert run.dp_size == 2


@pytest.mark.parametrize("world, micro, accumulation", [(1, 8, 2), (2, 8, 1), (4, 4, 1)])
def test_the_configs_micro_batch_is_the_most_a_rank_runs(data, tmp_path, monkeypatch, world, micro,
                                                         accumulation):
    """Global batch 16, the config's micro-batch 8: more ranks than two run smaller ones, so that
    one config serves every data-parallel size; an explicit --micro-batch is kept as given."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    run = load(base(data, tmp_path, "--global-batch", "16"))
    config = run.ds_config
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (
        micro, accumulation)
    said = f"global batch 16 = micro-batch {micro} x accumulation {accumulation} x dp {world}"
    if micro < 8:  # what the config logic changed by itself is said in the start line
        said += f" ({CPU_CONFIG}'s micro-batch 8 lowered to {micro}, each rank's share; " \
                "--micro-batch sets it)"
    assert str(run.batch_split) == said
    assert "not a multiple of micro-batch 8 x 4" in fails(
        base(data, tmp_path, "--global-batch", "16", "--micro-batch", "8"), monkeypatch, world=4)


def saved_checkpoint(out, **layout):
    """A complete checkpoint holding only what the configuration reads: its manifest with the
    layout (and the name of a ZeRO optimizer shard), committed in the run's history."""
    step = out / "checkpoints" / "step3"
    step.mkdir(parents=True)
    saved = {"world_size": 2, "tp": 1, "pp": 1, "dp": 2, "zero_stage": 2, "micro_batch": 8,
             "gradient_accumulation": 1, "vocab_size": 1024, **layout}
    (step / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_text("")
    manifest.write(str(step), {"tag": "step3", "step": 3, "id": "a-checkpoint", "lineage": "L",
                               "identity": {}, "layout": saved, "files": manifest.describe(
                                   str(step), ["zero_pp_rank_0_mp_rank_00_optim_states.pt"])})
    history.append(str(out), [], [history.record("committed", id="a-checkpoint", step=3,
                                                 lineage="L", files={})])


def test_a_checkpoint_of_another_layout_is_converted_or_refused_before_any_process_starts(
        data, tmp_path, monkeypatch):
    monkeypatch.setattr(config, "refuse_another_run", lambda *args: None)  # layouts alone here
    saved_checkpoint(tmp_path / "run", world_size=4, dp=4, vocab_size=1280)
    monkeypatch.setenv("WORLD_SIZE", "2")
    run = load(base(data, tmp_path, "--tp", "2"))
    assert run.resume_plan.resharding.convert and run.resume_plan.resharding.saved.dp == 4
    assert run.ds_config["checkpoint"]["load_universal"]
    assert run.models[0].vocab_size == 1280  # the checkpoint's padding, not this tp's (1024)
    assert "--resume never, and it holds checkpoints of a run (step3)" in fails(
        base(data, tmp_path, "--resume", "never"), monkeypatch)

    saved_checkpoint(tmp_path / "pp", world_size=2, pp=2, dp=1)
    message = fails(base(data, tmp_path, out=str(tmp_path / "pp")), monkeypatch, world=4)
    assert "pipeline-parallel checkpoints resume only on their own layout" in message
    assert "resume on 2 processes with --tp 1 --pp 2 (the layout that wrote it)" in message
    saved_checkpoint(tmp_path / "vocab", vocab_size=1152)
    assert "padded to 1152 for tp 1, which does not split into --tp 2 shards" in fails(
        base(data, tmp_path, "--tp", "2", out=str(tmp_path / "vocab")), monkeypatch, world=4)
    saved_checkpoint(tmp_path / "zero3", zero_stage=3)
    assert "resume with --zero-stage 3" in fails(  # ZeRO-2 <-> 3, whatever the layout
        base(data, tmp_path, out=str(tmp_path / "zero3")), monkeypatch, world=2)
    assert "reshapes checkpoints of ZeRO stage 0-2 only" in fails(
        base(data, tmp_path, "--zero-stage", "3", out=str(tmp_path / "zero3")), monkeypatch,
        world=4)


def test_the_index_cache_folder(data, tmp_path, monkeypatch):
    """--data where this process may write, else OUT/index-cache, or --index-cache; a folder
    that cannot be made is named before any work."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert load(base(data, tmp_path)).index_cache == data
    chosen = tmp_path / "cache"
    assert load(base(data, tmp_path, "--index-cache", str(chosen))).index_cache == str(chosen)
    assert chosen.is_dir()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert f"--index-cache {blocker}/cache: cannot create it" in fails(
        base(data, tmp_path, "--index-cache", str(blocker / "cache")), monkeypatch)
    assert "--prefetch must be 0 (no thread) or more" in fails(
        base(data, tmp_path, "--prefetch", "-1"), monkeypatch)
    may_write = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: may_write(path, mode) and path != data)
    assert load(base(data, tmp_path)).index_cache == str(tmp_path / "run" / "index-cache")
