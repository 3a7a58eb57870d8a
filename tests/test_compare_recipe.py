"""tupe-compare --recipe: the flags the modern recipe adds (exact), its batch ramp for several
batch splits against megatron-core's own calculator, a flag given winning over the recipe's, its
bf16 config where every GPU has bf16, the refusal of another recipe (or of flags it would scale
otherwise) in a comparison's folder, the report's recipe lines, Figure 5's FLOPs under a ramp and
make compare's folder per recipe. Nothing is launched.

test_a_modern_plan_passes_tupe_pretrains_checks needs tupe-pretrain's --lr-schedule,
--decay-steps, --decay-shape and --rampup-batch-size, and is skipped until they exist."""

import json
import os
import subprocess

import pytest
from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

from runs import CPU_CONFIG
from tupe_ds.compare import cli, recipes, results
from tupe_ds.compare import plan as plan_module
from tupe_ds.compare.plan import Plan, read_plan
from tupe_ds.compare.recipes import Recipe, batch_ramp, modern
from tupe_ds.compare.report import write_report
from tupe_ds.machine.doctor import Machine
from tupe_ds.tools.errors import CompareError, Refused
from tupe_ds.train.ds_config import BatchSplit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FP16_CONFIG = os.path.join(ROOT, "ds_configs", "bert_base_fp16.json")
BF16_CONFIG = os.path.join(ROOT, "ds_configs", "demo_bf16.json")
CPU = Machine("cpu", 0)
A100S = Machine("cuda", 2, ((8, 0), (9, 0)))
FLAGS = ("--model", "tiny", "--objective", "mlm", "--ds-config", FP16_CONFIG)


def config(path) -> dict:
    with open(path) as f:
        return json.load(f)


def split(global_batch, micro, dp) -> BatchSplit:
    return BatchSplit(global_batch, micro, global_batch // (micro * dp), dp)


def modern_recipe(flags=FLAGS, steps=100, batch=split(16, 4, 2), machine=CPU,
                  path=FP16_CONFIG, warmup=10) -> Recipe:
    return modern(steps, batch, warmup, machine, flags, config(path), path, "/c")


def plan(out, recipe=Recipe(), steps=100) -> Plan:
    return Plan(out=str(out), data=("/d",), encodings=("bert-a", "tupe-r"), seeds=(1,),
                steps=steps, baseline="bert-a", processes=2, pretrain_flags=FLAGS,
                recipe=recipe)


def test_the_paper_recipe_adds_nothing():
    made = plan("/c")
    assert made.pretrain_argv(made.runs[1]) == [
        "--data", "/d", "--out", "/c/runs/tupe-r-seed1", "--pos-encoding", "tupe-r", "--seed",
        "1", "--steps", "100", *FLAGS]


def test_the_modern_recipe_adds_its_flags_scaled_to_the_run():
    recipe = modern_recipe()  # global batch 16 = micro-batch 4 x accumulation 2 x dp 2
    assert recipe.name == "modern" and recipe.ds_config is None  # a CPU: the config's precision
    assert recipe.flags == ("--mask-rate", "0.3", "--lr-schedule", "wsd", "--decay-steps", "20",
                            "--decay-shape", "1-sqrt", "--rampup-batch-size", "8", "8", "200")
    assert recipe.notes == (
        "mask rate 0.3 (`--mask-rate 0.3`)",
        "learning-rate schedule: the warmup as configured, a stable rate, then a 1-sqrt decay to "
        "the minimum over the last 20 of the 100 steps (`--lr-schedule wsd --decay-steps 20 "
        "--decay-shape 1-sqrt`)",
        "batch ramp: 8 to 16 samples a step by 8 over the first 200 samples, the full batch from "
        "step 26 of 100 (`--rampup-batch-size 8 8 200`)",
        "precision fp16, the --ds-config's (no GPU: bf16 is for GPUs that all have it, as make "
        "demo chooses)")
    made = plan("/c", recipe)
    assert made.pretrain_argv(made.runs[0]) == [
        "--data", "/d", "--out", "/c/runs/bert-a-seed1", "--pos-encoding", "bert-a", "--seed",
        "1", "--steps", "100", *FLAGS, *recipe.flags]
    assert [recipes.decay_steps(steps) for steps in (1, 2, 3, 10, 200, 1001)] == [
        1, 1, 1, 2, 40, 200]


def test_the_decay_is_cut_to_what_the_warmup_leaves():
    # at most steps - warmup - 1: the peak reached at step warmup + 2 (schedule.decay_room)
    assert modern_recipe(steps=40, warmup=36).flags[4:6] == ("--decay-steps", "3")
    assert modern_recipe(steps=40, warmup=38).flags[4:6] == ("--decay-steps", "1")
    filled = modern_recipe(steps=40, warmup=39)
    assert filled.flags[:4] == ("--mask-rate", "0.3", "--rampup-batch-size", "8")
    assert filled.notes[1] == ("no warmup-stable-decay: a warmup of 39 steps leaves no step at "
                               "the peak before a decay in 40; the --ds-config's schedule kept "
                               "(more --steps or fewer --warmup-steps make room)")


def megatron_batches(ramp, micro, dp) -> list:
    """Each step's global batch until the first full one, by megatron-core's calculator."""
    calculator = RampupBatchsizeNumMicroBatchesCalculator(
        ramp.global_batch, micro, dp, False, 1, ramp.start, ramp.increment, ramp.samples)
    batches, consumed = [], 0
    while True:
        calculator.update(consumed, consistency_check=True)  # asserts a multiple of micro x dp
        batch = calculator.get_current_global_batch_size()
        if batch == ramp.global_batch:
            return batches
        batches.append(batch)
        consumed += batch


@pytest.mark.parametrize("global_batch, micro, dp, steps", [
    (16, 8, 1, 200), (16, 4, 2, 100), (32, 1, 1, 100), (256, 128, 1, 1000), (4096, 8, 64, 100000),
    (4608, 96, 8, 5000), (128, 4, 2, 7), (24, 8, 1, 40), (16, 1, 1, 4), (40, 8, 1, 3),
    (16, 2, 2, 1), (2, 1, 1, 1)])
def test_the_ramp_keeps_megatrons_rules_and_ends_after_a_quarter_of_the_steps(
        global_batch, micro, dp, steps):
    ramp = batch_ramp(split(global_batch, micro, dp), steps)
    unit = micro * dp
    assert ramp.global_batch == global_batch and ramp.increment == unit
    assert ramp.start % unit == 0 and 0 < ramp.start < global_batch
    assert ramp.start >= global_batch / 8 and ramp.start - unit < max(global_batch / 8, unit)
    assert (global_batch - ramp.start) % ramp.increment == 0 and ramp.samples >= 1
    batches = list(ramp.batches())
    assert batches == megatron_batches(ramp, micro, dp)
    assert batches == sorted(batches) and batches[0] == ramp.start
    assert all(batch % unit == 0 for batch in batches)
    target = max(1, round(steps / 4))
    assert target <= len(batches) <= target + 1 and ramp.full_from == len(batches) + 1


@pytest.mark.parametrize("global_batch, micro, dp", [(16, 8, 2), (4608, 96, 48), (1, 1, 1)])
def test_no_ramp_where_the_global_batch_is_one_micro_batch_per_rank(global_batch, micro, dp):
    batch = split(global_batch, micro, dp)
    assert batch_ramp(batch, 100) is None
    recipe = modern_recipe(batch=batch)
    assert "--rampup-batch-size" not in recipe.flags
    assert recipe.notes[2] == (f"no batch ramp: the global batch {global_batch} is one "
                               f"micro-batch ({micro}) per data-parallel rank ({dp}), and every "
                               "batch of a ramp is a multiple of that; a larger --global-batch "
                               "or a smaller --micro-batch allows one")


def test_a_flag_given_wins_over_the_recipes():
    given = modern_recipe((*FLAGS, "--mask-rate=0.4", "--lr-schedule", "cosine",
                           "--rampup-batch-size", "4", "4", "64"))
    assert given.flags == ()
    assert given.notes[:3] == (
        "mask rate 0.4: --mask-rate given, kept (the recipe's is 0.3)",
        "learning-rate schedule cosine: --lr-schedule given, kept (the recipe's is wsd, 1-sqrt "
        "decay over the last 20% of the steps)",
        "batch ramp: --rampup-batch-size given, kept")
    decay = modern_recipe((*FLAGS, "--decay-steps", "5"))
    assert decay.flags[:6] == ("--mask-rate", "0.3", "--lr-schedule", "wsd", "--decay-shape",
                               "1-sqrt")
    assert decay.notes[1].endswith("decay to the minimum over the last 5 of the 100 steps "
                                   "(`--lr-schedule wsd --decay-shape 1-sqrt`); --decay-steps "
                                   "given, kept")
    wsd = modern_recipe((*FLAGS, "--lr-schedule", "wsd", "--decay-shape=linear"))
    assert wsd.flags[:4] == ("--mask-rate", "0.3", "--decay-steps", "20")
    assert "a linear decay" in wsd.notes[1]


def test_a_flag_given_under_megatrons_name_or_another_case_wins_as_well():
    megatron = modern_recipe((*FLAGS, "--lr-decay-style", "cosine"))
    assert "--lr-schedule" not in megatron.flags and "--lr-decay-style" not in megatron.flags
    assert megatron.notes[1].startswith("learning-rate schedule cosine: --lr-schedule given, kept")
    upper = modern_recipe((*FLAGS, "--lr-schedule=WSD", "--lr-wsd-decay-iters", "5"))
    assert upper.flags[:4] == ("--mask-rate", "0.3", "--decay-shape", "1-sqrt")
    assert "over the last 5 of the 100 steps" in upper.notes[1]
    deepspeed_name = ("--model", "tiny", "--deepspeed_config", FP16_CONFIG)
    recipe = modern_recipe(deepspeed_name, machine=A100S)
    applied = recipe.applied_to(deepspeed_name)  # its bf16 config in place of the user's
    assert "--deepspeed_config" not in applied and applied.count("--ds-config") == 1


def test_bf16_where_every_gpu_has_it_in_a_config_of_the_comparison():
    recipe = modern_recipe(machine=A100S)
    made = "/c/" + recipes.DS_CONFIG_FILE
    assert recipe.flags[-2:] == ("--ds-config", made) and recipe.ds_config_file == made
    original = config(FP16_CONFIG)
    assert recipe.ds_config == {**{k: v for k, v in original.items() if k != "fp16"},
                                "bf16": {"enabled": True}}
    assert recipe.notes[3] == (f"precision bf16 (these GPUs have it): {made}, {FP16_CONFIG} "
                               f"with bf16 in place of its fp16 (`--ds-config {made}`)")
    argv = plan("/c", recipe).pretrain_argv(plan("/c").runs[0])
    assert argv.count("--ds-config") == 1 and argv[argv.index("--ds-config") + 1] == made
    assert argv[-len(recipe.flags):] == list(recipe.flags)

    older = modern_recipe(machine=Machine("cuda", 2, ((8, 0), (7, 0))))
    assert older.ds_config is None and "--ds-config" not in older.flags
    assert older.notes[3] == ("precision fp16, the --ds-config's (these GPUs lack bf16, which "
                              "needs compute capability 8.0 or newer)")
    bf16 = modern_recipe(machine=A100S, path=BF16_CONFIG)
    assert bf16.ds_config is None and bf16.notes[3] == "precision bf16, the --ds-config's"


def test_another_recipe_in_a_comparisons_folder_is_refused(tmp_path):
    out = tmp_path / "cmp"
    plan(out).save()
    recipe = modern(100, split(16, 4, 2), 10, A100S, FLAGS, config(FP16_CONFIG), FP16_CONFIG,
                    str(out))
    with pytest.raises(CompareError, match="this comparison was started with --recipe paper, "
                                           "not modern; give the modern recipe its own --out"):
        plan(out, recipe).save()
    modern_out = tmp_path / "cmp-modern"
    recipe = modern(100, split(16, 4, 2), 10, A100S, FLAGS, config(FP16_CONFIG), FP16_CONFIG,
                    str(modern_out))
    plan(modern_out, recipe).save()
    assert read_plan(str(modern_out)) == plan(modern_out, recipe)
    assert config(modern_out / recipes.DS_CONFIG_FILE) == recipe.ds_config
    plan(modern_out, recipe).save()  # the same again: resumed
    with pytest.raises(CompareError, match="started with --recipe modern, not paper"):
        plan(modern_out).save()
    longer = modern(200, split(16, 4, 2), 10, A100S, FLAGS, config(FP16_CONFIG), FP16_CONFIG,
                    str(modern_out))
    with pytest.raises(CompareError, match="--decay-steps 20 .*, and would now give them "
                                           ".*--decay-steps 40 .*it scales its decay and "
                                           "batch ramp to --steps"):
        plan(modern_out, longer, steps=200).save()
    cpu = modern(100, split(16, 4, 2), 10, CPU, FLAGS, config(FP16_CONFIG), FP16_CONFIG,
                 str(modern_out))
    with pytest.raises(CompareError, match="its precision to this machine's GPUs"):
        plan(modern_out, cpu).save()
    older = json.loads((out / "compare.json").read_text())
    del older["recipe"]  # a plan written before recipes existed
    (out / "compare.json").write_text(json.dumps(older))
    assert read_plan(str(out)).recipe == Recipe()


def test_another_recipe_is_refused_before_tupe_pretrain_reads_the_runs(tmp_path, monkeypatch):
    out = tmp_path / "cmp"
    plan(out, modern_recipe()).save()

    def load(*args, **kwargs):  # what a run's checkpoint made under the recipe's flags says
        raise Refused("its checkpoint is another run than this command's")

    monkeypatch.setattr(plan_module, "load", load)
    with pytest.raises(CompareError, match="started with --recipe modern, not paper"):
        plan(out).check()


def test_figure_5s_flops_count_a_ramps_smaller_batches():
    description = {"flops_per_step": 160.0, "global_batch": 16}  # 10 FLOPs a sample
    assert results.flops_by_step(description, [10, 30]) == [1600.0, 4800.0]
    ramped = {**description, "rampup_batch_size": "8 8 200"}  # 25 steps of 8, then 16
    assert results.flops_by_step(ramped, [10, 25, 26, 30]) == [800.0, 2000.0, 2160.0, 2800.0]
    assert results.flops_by_step(None, [10]) == [0.0]


def test_the_report_names_the_recipe_and_what_it_set(tmp_path):
    recipe = modern_recipe()
    made = write_report(plan(tmp_path / "modern", recipe))
    assert made["recipe"] == {"name": "modern", "flags": list(recipe.flags),
                              "notes": list(recipe.notes)}
    text = (tmp_path / "modern" / "report.md").read_text()
    assert ("Recipe: modern (`--recipe modern`), added to every run's flags: `--mask-rate 0.3 "
            "--lr-schedule wsd --decay-steps 20 --decay-shape 1-sqrt --rampup-batch-size 8 8 "
            "200`.") in text
    assert all(f"- {note}\n" in text for note in recipe.notes)
    write_report(plan(tmp_path / "paper"))
    assert ("Recipe: paper (`--recipe paper`): the runs trained as the flags and --ds-config "
            "say, nothing added.") in (tmp_path / "paper" / "report.md").read_text()


def plan_args(data, out, *flags):
    return cli.plan_parser("tupe-compare plan", "").parse_known_args(
        ["--data", data, "--out", str(out), "--encodings", "bert-a,tupe-r", "--steps", "40",
         "--model", "tiny", "--ds-config", CPU_CONFIG, "--seq-len", "64", *flags])


@pytest.mark.parametrize("flags, ramp", [
    (("--nproc", "1"), ("8", "8", "80")),  # cpu_zero2.json: 16 = micro 8 x accumulation 2
    (("--nproc", "2", "--global-batch", "32"), ("16", "16", "160")),
    (("--nproc", "2"), None)])  # 16 = micro 8 x dp 2: nothing smaller
def test_a_modern_plan_takes_its_batch_from_tupe_pretrains_rules(data, tmp_path, flags, ramp,
                                                                 monkeypatch):
    loaded, real_load = [], plan_module.load

    def load(argv, **kwargs):
        loaded.append(argv[argv.index("--out") + 1])
        return real_load(argv, **kwargs)

    monkeypatch.setattr(plan_module, "load", load)
    made = cli.make_plan(*plan_args(data, tmp_path / "cmp", "--recipe", "modern", *flags))
    # not the run's folder: its checkpoints, made with the recipe's flags, refuse the others
    assert len(loaded) == 1 and not loaded[0].startswith(str(tmp_path))
    assert made.recipe.flags == ("--mask-rate", "0.3", "--lr-schedule", "wsd", "--decay-steps",
                                 "8", "--decay-shape", "1-sqrt",
                                 *(("--rampup-batch-size", *ramp) if ramp else ()))
    argv = made.pretrain_argv(made.runs[0])
    assert argv[-len(made.recipe.flags):] == list(made.recipe.flags)
    assert not (tmp_path / "cmp").exists()
    paper = cli.make_plan(*plan_args(data, tmp_path / "cmp", *flags))
    assert paper.recipe == Recipe()


def test_a_schedule_named_without_its_decay_gets_the_recipes(data, tmp_path):
    made = cli.make_plan(*plan_args(data, tmp_path / "cmp", "--recipe", "modern", "--nproc", "2",
                                    "--lr-schedule", "wsd", "--warmup-steps", "35"))
    assert made.recipe.flags == ("--mask-rate", "0.3", "--decay-steps", "4", "--decay-shape",
                                 "1-sqrt")  # 40 steps: the 35 of warmup leave 4 (decay_room)


def test_a_modern_plan_passes_tupe_pretrains_checks(data, tmp_path, capsys):
    out = tmp_path / "cmp"
    argv = ["plan", "--data", data, "--out", str(out), "--encodings", "bert-a,tupe-r",
            "--steps", "40", "--model", "tiny", "--ds-config", CPU_CONFIG, "--seq-len", "64",
            "--nproc", "1"]
    assert cli.main([*argv, "--recipe", "modern"]) == 0
    printed = capsys.readouterr()
    assert "2 runs planned" in printed.out
    assert "tupe-compare: --recipe modern: batch ramp: 8 to 16 samples" in printed.err
    assert cli.main(["run-flags", str(out), "1"]) == 0
    assert capsys.readouterr().out.split("\n")[-13:-1] == [
        "--mask-rate", "0.3", "--lr-schedule", "wsd", "--decay-steps", "8", "--decay-shape",
        "1-sqrt", "--rampup-batch-size", "8", "8", "80"]
    assert cli.main(argv) == 2
    assert "started with --recipe modern, not paper" in capsys.readouterr().err


def test_make_compare_gives_each_recipe_its_folder():
    def command(*variables):
        made = subprocess.run(["make", "-s", "-n", "-C", ROOT, "compare", *variables],
                              capture_output=True, text=True, timeout=60)
        assert made.returncode == 0, made.stderr
        return " ".join(made.stdout.replace("\\\n", " ").split())

    assert "--out build/compare --recipe paper " in command()
    assert "--out build/compare-modern --recipe modern " in command("COMPARE_RECIPE=modern")
