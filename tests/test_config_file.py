"""One config file or none: --config FILE (TOML, keys spelled as the flags) under the flags,
--print-config, the names Megatron-LM and DeepSpeed users type, the model shape flags, and the
settings a run records for `tupe-pretrain --out RUN` alone (tests/test_schedules.py resumes a
real run that way)."""

import json
import os
import subprocess
import sys

import pytest

from tupe_ds.tools import command_line, settings
from tupe_ds.tools.errors import Refused
from tupe_ds.train import flags
from tupe_ds.train.checkpoint import history
from tupe_ds.train.config import load
from tupe_ds.train.run_folder import recorded_settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_CONFIG = os.path.join(ROOT, "ds_configs", "cpu_zero2.json")
MEGATRON = ["--data-path", "prep", "--deepspeed_config", "c.json", "--out", "run",
            "--train-iters", "7", "--seq-length", "128", "--micro-batch-size", "4",
            "--global-batch-size", "32", "--tensor-model-parallel-size", "2",
            "--pipeline-model-parallel-size", "2", "--lr-warmup-iters", "3"]
OURS = ["--data", "prep", "--ds-config", "c.json", "--out", "run", "--steps", "7",
        "--seq-len", "128", "--micro-batch", "4", "--global-batch", "32", "--tp", "2",
        "--pp", "2", "--warmup-steps", "3"]


def pretrain_args(argv):
    return command_line.parse(flags.parser(), argv)


def write(path, text):
    path.write_text(text)
    return str(path)


def test_megatron_and_deepspeed_names_are_the_same_flags_and_help_lists_them():
    assert vars(pretrain_args(MEGATRON)) == vars(pretrain_args(OURS))
    help_text = " ".join(flags.parser().format_help().split())
    for name in MEGATRON[::2]:
        assert name in help_text, name


def test_the_file_sets_what_the_flags_do_not_and_the_flags_win(tmp_path):
    config = write(tmp_path / "run.toml", 'data-path = ["prep"]\ndeepspeed_config = "c.json"\n'
                   'seq-length = 128\nsteps = 7\nbf16 = true\nmask-split = "0.7,0.2"\n'
                   'rampup-batch-size = [8, 8, 64]\nlr = 1e-4\n')
    args = pretrain_args(["--config", config, "--out", "run", "--seq-len", "256"])
    assert (args.data, args.ds_config, args.seq_len, args.steps, args.bf16) == \
        ([str(tmp_path / "prep")], str(tmp_path / "c.json"), 256, 7, True)
    assert args.out == "run"  # the command line's: relative to the working directory
    assert args.mask_split == (0.7, 0.2) and args.rampup_batch_size == [8, 8, 64]
    assert args.lr == 1e-4


def test_paths_in_the_file_are_relative_to_its_folder_from_any_working_directory(
        tmp_path, monkeypatch):
    from data_prep.cli import prep_parser
    from tupe_ds.finetune.run import parser as finetune_parser

    folder = tmp_path / "configs"
    folder.mkdir()
    config = write(folder / "run.toml", 'data = ["0.7", "wiki=../prep/wiki", "3e9", "/abs/books"]'
                   '\nds-config = "ds.json"\nout = "~/runs/large"\ninit-from = "../runs/p1"\n'
                   'steps = 7\nresume-from = "step4"\n')
    monkeypatch.chdir("/")
    args = pretrain_args(["--config", config])
    assert args.data == ["0.7", f"wiki={tmp_path}/prep/wiki", "3e9", "/abs/books"]
    assert (args.ds_config, args.init_from) == (str(folder / "ds.json"), str(tmp_path / "runs/p1"))
    assert args.out == os.path.expanduser("~/runs/large") and args.resume_from == "step4"
    finetune = command_line.parse(finetune_parser(), ["--config", write(
        folder / "ft.toml", 'model = "m"\ntask = "rte"\ntrain = "t.tsv"\nvalid = ["dev=d.tsv"]\n'
                            'out = "o"\n')])
    assert (finetune.model, finetune.train, finetune.valid, finetune.out) == (
        str(folder / "m"), str(folder / "t.tsv"), [f"dev={folder}/d.tsv"], str(folder / "o"))
    prep = command_line.parse(prep_parser(), ["--config", write(
        folder / "prep.toml", 'input = ["../corpora/a.txt", "lang=en"]\nout = "../prep"\n')])
    assert (prep.inputs, prep.output) == (  # a folder named lang=en is one path
        [str(tmp_path / "corpora/a.txt"), str(folder / "lang=en")], str(tmp_path / "prep"))
    numbers = pretrain_args(["--config", write(folder / "n.toml", 'data = ["2024"]\nout = 2025\n'
                                               'ds-config = "bs=large"\nsteps = 1\n')])
    assert (numbers.data, numbers.out, numbers.ds_config) == (
        [str(folder / "2024")], str(folder / "2025"), str(folder / "bs=large"))


def test_a_config_written_when_its_paths_were_the_working_directorys_is_refused(
        tmp_path, monkeypatch, capsys):
    """A relative path that names nothing from the file's folder but something from the working
    directory: the file was written before paths were the file's; refused, naming both."""
    (tmp_path / "configs").mkdir()
    (tmp_path / "runs" / "a").mkdir(parents=True)
    config = write(tmp_path / "configs" / "old.toml", 'out = "runs/a"\n')
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        pretrain_args(["--config", "configs/old.toml", "--data", "d", "--ds-config", "c.json",
                       "--steps", "3"])
    assert exit_.value.code == 2
    assert (f"--config configs/old.toml: out = 'runs/a' is relative to the file's folder, "
            f"{tmp_path}/configs, where {tmp_path}/configs/runs/a is not; {tmp_path}/runs/a (from "
            "the working directory) is: write that path") in capsys.readouterr().err
    write(tmp_path / "configs" / "old.toml", 'out = "../runs/a"\n')  # as the message says
    assert pretrain_args(["--config", config, "--data", "d", "--ds-config", "c.json", "--steps",
                          "3"]).out == str(tmp_path / "runs" / "a")


def test_megatron_names_of_another_meaning_are_refused_saying_what_to_give(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        pretrain_args([*OURS, "--save", "run", "--hidden-dropout=0.1", "--stpes", "3"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[0] == (
        "tupe-pretrain: error: unrecognized arguments: --save run --hidden-dropout=0.1 --stpes 3; "
        "--save: one --out holds the checkpoints (OUT/checkpoints), TensorBoard and the log; "
        "--hidden-dropout: --dropout sets the hidden and the attention dropout together; "
        "--stpes: did you mean --steps?")
    with pytest.raises(SystemExit):
        pretrain_args(["--config", write(tmp_path / "c.toml", "weight-decay = 0.1\n")])
    assert "weight-decay is not a setting of tupe-pretrain (keys are its flags without the " \
        "dashes: tupe-pretrain --help); the --ds-config's optimizer params set it " \
        "(weight_decay)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pretrain_args(["--config", write(tmp_path / "u.toml", "clip_grad = 1.0\n")])
    assert "clip_grad is not a setting of tupe-pretrain (keys are its flags without the dashes: " \
        "tupe-pretrain --help); the --ds-config's gradient_clipping sets it" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        pretrain_args([*OURS, "--min_lr", "1e-5"])
    assert "--min_lr: the --ds-config's scheduler sets the minimum" in capsys.readouterr().err
    assert pretrain_args([*OURS, "--lr-decay-style", "WSD"]).lr_schedule == "wsd"  # Megatron's
    assert pretrain_args([*OURS, "--lr-decay-style", "cosine"]).lr_schedule == "cosine"
    with pytest.raises(SystemExit):
        pretrain_args([*OURS, "--lr-decay-style", "inverse-square-root"])
    assert "invalid choice: 'inverse-square-root'" in capsys.readouterr().err


def test_a_mistyped_flag_is_one_line_with_the_flag_meant_then_where_help_is(capsys):
    """As the same typo in a file: "did you mean", and argparse's usage block left out."""
    with pytest.raises(SystemExit) as exit_:
        pretrain_args(["--out", "run", "--data", "d", "--seq-lenght", "64", "--stpes=3",
                       "extra"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "tupe-pretrain: error: unrecognized arguments: --seq-lenght 64 --stpes=3 extra; "
        "--seq-lenght: did you mean --seq-length?; --stpes: did you mean --steps?",
        "see tupe-pretrain --help"]
    with pytest.raises(SystemExit):  # a name cut short: the flags it begins, not --seed
        pretrain_args(["--out", "run", "--data", "d", "--seq", "32", "--eval", "2", "--l", "1",
                       "--local", "0"])
    assert capsys.readouterr().err.splitlines()[0].endswith(  # none for a letter, none hidden
        "--seq: did you mean --seq-len?; --eval: did you mean --eval-samples or --eval-interval?")


def test_help_wins_over_any_error(capsys):
    for argv in (["-h", "--config", "/missing.toml"], ["--seq-len", "32", "--seq-length", "64",
                                                       "--help", "--stpes", "3"]):
        with pytest.raises(SystemExit) as exit_:
            pretrain_args(argv)
        assert exit_.value.code == 0
        printed = capsys.readouterr()
        assert printed.out.startswith("usage: tupe-pretrain") and printed.err == ""


def test_a_setting_given_under_two_of_its_names_is_refused_as_in_a_file(capsys):
    """Megatron-LM's name beside ours: argparse kept the last (--seq-len 32 --seq-length 128
    trained at 128); a name repeated stays the last one's, as argparse's."""
    for argv, said in ((["--seq-len", "32", "--seq-length", "128"], "--seq-len and --seq-length"),
                       (["--tp=2", "--tensor-model-parallel-size", "2"],
                        "--tp and --tensor-model-parallel-size")):
        with pytest.raises(SystemExit) as exit_:
            pretrain_args(["--out", "run", "--data", "d", *argv])
        assert exit_.value.code == 2
        assert capsys.readouterr().err.splitlines() == [
            f"tupe-pretrain: error: {said} are one setting: give it once",
            "see tupe-pretrain --help"]
    assert pretrain_args(["--out", "run", "--data", "d", "--ds-config", "c.json", "--steps", "3",
                          "--seq-len", "32", "--seq-len", "64"]).seq_len == 64


@pytest.mark.parametrize("text, said", [
    ("seqlen = 1\n", "seqlen is not a setting of tupe-pretrain"),
    ("seqlen = 1\n", "did you mean seq-len?"),
    ("seq = 1\n", "did you mean seq-len?"),  # one name per setting
    ('seq-len = "many"\n', "seq-len = 'many': invalid int value"),
    ('pos-encoding = "sinusoid"\n', "pos-encoding = 'sinusoid': choose one of"),
    ("bf16 = 1\n", "bf16 = 1: give true or false"),
    ("seq-len = [1, 2]\n", "seq-len = [1, 2]: give one value"),
    ("rampup-batch-size = [8, 8]\n", "give 3 values"),
    ("mask-rate = 1.5\n", "mask-rate = 1.5: 1.5: the share of tokens chosen must be above 0"),
    ("seq-len = 1\nseq-length = 2\n", "seq-length sets --seq-len a second time"),
    ('mask-split = [0.8, 0.1]\n', 'several in one: "0.8,0.1"'),
    ("seq-len = \n", "not TOML"),
    ("verbose = true\n", "verbose is given on the command line only (--verbose; or "
                         "TUPE_DS_VERBOSE=1 in the environment"),
    ("print-config = true\n", "print-config is given on the command line only (--print-config)"),
])
def test_a_bad_file_is_refused_naming_it_and_the_key(tmp_path, capsys, text, said):
    config = write(tmp_path / "bad.toml", text)
    with pytest.raises(SystemExit) as exit_:
        pretrain_args(["--config", config, "--out", "run", "--data", "d", "--ds-config", "c",
                       "--steps", "1"])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert f"--config {config}" in error and said in error, error


@pytest.mark.parametrize("make, said", [
    (lambda path: path.write_bytes("seed = 1\n".encode("utf-16")), "not UTF-8 text"),
    (lambda path: path.write_bytes(b"\xef\xbb\xbfseed = 1\n"), "byte-order mark"),
    (lambda path: os.mkfifo(path), "c.toml: a FIFO, not a file: give a TOML file of settings"),
    (lambda path: path.mkdir(), "c.toml: a folder, not a file: give a TOML"),  # not "remove it"
    (lambda path: path.write_text("# " + "x" * (1 << 20) + "\n"), "bytes; a settings file is"),
])
def test_a_file_that_is_no_settings_file_is_refused_at_once(tmp_path, capsys, make, said):
    make(tmp_path / "c.toml")
    with pytest.raises(SystemExit):
        pretrain_args(["--config", str(tmp_path / "c.toml")])
    assert said in capsys.readouterr().err


def test_one_config_file(tmp_path, capsys):
    first, second = write(tmp_path / "a.toml", ""), write(tmp_path / "b.toml", "")
    with pytest.raises(SystemExit):
        pretrain_args(["--config", first, "--config", second])
    assert "give one file" in capsys.readouterr().err


def test_required_flags_come_from_the_file_or_the_command_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        pretrain_args(["--config", write(tmp_path / "part.toml", 'data = ["prep"]\n'),
                       "--out", "run"])
    error = capsys.readouterr().err
    assert "required: --ds-config/--deepspeed_config/--deepspeed-config, " \
           "--steps/--train-iters" in error
    assert "--data" not in error.split("required:")[1]
    with pytest.raises(SystemExit):
        pretrain_args(["--config", str(tmp_path / "missing.toml")])
    assert "missing.toml: cannot read it (No such file or directory)" in capsys.readouterr().err


def test_print_config_says_where_each_setting_came_from_and_is_a_config_file(tmp_path, capsys):
    config = write(tmp_path / "run.toml", 'data = ["prep"]\nseq-length = 128\nsteps = 7\n'
                   'mask-split = "0.7,0.2"\nds-config = "c \\"quoted\\".json"\n')
    argv = ["--config", config, "--out", "run", "--steps", "9", "--num-layers", "3"]
    with pytest.raises(SystemExit) as exit_:
        pretrain_args([*argv, "--print-config"])
    assert exit_.value.code == 0
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert f"seq-len = 128  # {config}" in lines
    assert "steps = 9  # command line" in lines and "num-layers = 3  # command line" in lines
    assert "dropout = 0.1  # default" in lines and "# lr = (not set)  # default" in lines
    again = pretrain_args(["--config", write(tmp_path / "printed.toml", printed)])
    assert f'out = "{os.path.abspath("run")}"  # command line' in lines  # the file read anywhere
    assert vars(again) == {**vars(pretrain_args(argv)), "config": str(tmp_path / "printed.toml"),
                           "out": os.path.abspath("run")}


def test_print_config_shows_each_environment_setting_as_the_command_uses_it(monkeypatch,
                                                                         capsys):
    """Every TUPE_DS_* setting, as a comment: the default, the environment's, or the default
    where the environment's is no value of it (TUPE_DS_VERBOSE=false is off, as the others)."""
    monkeypatch.setenv("TUPE_DS_LOCK_LEASE_SECONDS", "45")
    monkeypatch.setenv("TUPE_DS_WAIT_NOTICE", "soon")
    monkeypatch.setenv("TUPE_DS_VERBOSE", "false")
    monkeypatch.delenv("TUPE_DS_READ_RETRY_SECONDS")  # the suite's 1 s
    with pytest.raises(SystemExit):
        pretrain_args(["--steps", "7", "--print-config"])
    lines = capsys.readouterr().out.splitlines()
    assert "# TUPE_DS_READ_RETRY_SECONDS = 120.0  # default (how long a read that fails is " \
           "retried)" in lines
    assert any(line.startswith("# TUPE_DS_LOCK_LEASE_SECONDS = 45.0  # environment (")
               for line in lines)
    assert any(line.startswith("# TUPE_DS_WAIT_NOTICE = 30.0  # default, the environment's "
                               "'soon' being no value of it (") for line in lines)
    assert any(line.startswith("# TUPE_DS_VERBOSE = false  # environment (") for line in lines)
    named = {line.split()[1] for line in lines if line.startswith("# TUPE_DS_")}
    assert named == set(settings.ENVIRONMENT)
    monkeypatch.setattr(sys, "argv", ["tupe-pretrain", "--verbose"])  # which exports it
    monkeypatch.setenv("TUPE_DS_VERBOSE", "1")
    with pytest.raises(SystemExit):
        pretrain_args(["--steps", "7", "--verbose", "--print-config"])
    assert any(line.startswith("# TUPE_DS_VERBOSE = true  # command line (--verbose) (")
               for line in capsys.readouterr().out.splitlines())


def test_print_config_shows_what_the_deepspeed_config_gives_the_flags_left_unset(capsys,
                                                                                monkeypatch):
    """As the run takes them: a warmup longer than --steps cut to it, a micro-batch larger than
    a data-parallel rank's share lowered to it (for the processes a launcher here says)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit):
        load(["--data", "d", "--out", "o", "--steps", "3", "--ds-config", CPU_CONFIG,
              "--lr", "0.5", "--print-config"])
    printed = capsys.readouterr().out.splitlines()
    with open(CPU_CONFIG) as f:
        config = json.load(f)
    assert (f"# global-batch = {config['train_batch_size']}  # not set: the --ds-config's, "
            f"{CPU_CONFIG}") in printed
    assert "lr = 0.5  # command line" in printed
    assert f'# lr-schedule = "linear"  # not set: the --ds-config\'s, {CPU_CONFIG}' in printed
    assert config["scheduler"]["params"]["warmup_num_steps"] == 20
    assert (f"# warmup-steps = 3  # not set: the --ds-config's, {CPU_CONFIG}: 20, cut to --steps "
            "3") in printed
    assert config["train_micro_batch_size_per_gpu"] == 8
    for world, share in (("1", 4), ("2", 2)):
        monkeypatch.setenv("WORLD_SIZE", world)
        with pytest.raises(SystemExit):
            load(["--data", "d", "--out", "o", "--steps", "30", "--ds-config", CPU_CONFIG,
                  "--global-batch", "4", "--print-config"])
        printed = capsys.readouterr().out.splitlines()
        assert (f"# micro-batch = {share}  # not set: the --ds-config's, {CPU_CONFIG}: 8, lowered "
                f"to the global batch 4's share of each of {world} data-parallel rank(s)"
                ) in printed
        assert f"# warmup-steps = 20  # not set: the --ds-config's, {CPU_CONFIG}" in printed


def test_print_config_shows_the_value_the_run_takes_for_each_flag_left_unset(tmp_path, capsys):
    """The preset's shape, the objective's masking, the device's compile, WSD's decay shape and
    the index cache: what the run uses, where a flag is left unset, without making a folder."""
    (tmp_path / "prep").mkdir()
    with pytest.raises(SystemExit):
        load(["--data", str(tmp_path / "prep"), "--out", str(tmp_path / "run"), "--steps", "3",
              "--ds-config", CPU_CONFIG, "--model", "bert-large", "--hidden-size", "512",
              "--lr-schedule", "wsd", "--decay-steps", "1", "--print-config"])
    printed = capsys.readouterr().out.splitlines()
    assert "# num-layers = 24  # not set: the bert-large preset's" in printed
    assert "hidden-size = 512  # command line" in printed
    assert "# mask-rate = 0.15  # not set: --objective mlm's" in printed
    assert '# mask-split = "0.8,0.1"  # not set: --objective mlm\'s' in printed
    assert '# decay-shape = "linear"  # not set: --lr-schedule wsd\'s' in printed
    assert any(line.startswith('# compile = "none"  # not set: the device\'s choice here (cpu;')
               for line in printed)
    assert f'# index-cache = "{tmp_path / "prep"}"  # not set: each --data folder where this ' \
           "process may write, else OUT/index-cache" in printed
    assert not (tmp_path / "run").exists()
    with pytest.raises(SystemExit):
        load(["--data", "d", "--out", "o", "--steps", "3", "--ds-config", CPU_CONFIG,
              "--objective", "electra", "--model", "tiny", "--print-config"])
    printed = capsys.readouterr().out.splitlines()
    assert "# num-layers = (not set)  # default" in printed  # ELECTRA's pair: no shape flags
    assert '# mask-split = "0.85,0"  # not set: --objective electra\'s' in printed
    assert "# decay-shape = (not set)  # default" in printed


def test_print_config_shows_the_compile_the_run_derives(capsys, monkeypatch):
    """On CUDA the run compiles the block at --tp 1, eagerly under ZeRO stage 3 or at --tp 2:
    the printed choice is the models' own (ModelConfig.compile_mode), not a copy of its rule."""
    import torch

    from tupe_ds.model import config as model_config
    from tupe_ds.train import config as run_config

    cuda = lambda: torch.device("cuda")  # noqa: E731
    monkeypatch.setattr(model_config, "accelerator_device", cuda)
    monkeypatch.setattr(run_config, "accelerator_device", cuda)
    shown = {}
    for layout in (["--zero-stage", "1"], ["--zero-stage", "3"], ["--tp", "2"]):
        with pytest.raises(SystemExit):
            load(["--data", "d", "--out", "o", "--steps", "3", "--ds-config", CPU_CONFIG,
                  "--print-config", *layout])
        shown[layout[0] + layout[1]] = next(
            line.split("#")[1].strip() for line in capsys.readouterr().out.splitlines()
            if line.startswith("# compile = "))
    assert shown == {"--zero-stage1": 'compile = "block"', "--zero-stage3": 'compile = "none"',
                     "--tp2": 'compile = "none"'}
    monkeypatch.setattr(model_config.ModelConfig, "compile_mode", "elementwise")  # a new rule
    with pytest.raises(SystemExit):
        load(["--data", "d", "--out", "o", "--steps", "3", "--ds-config", CPU_CONFIG,
              "--print-config"])
    assert any(line.startswith('# compile = "elementwise"  # not set: the device\'s choice')
               for line in capsys.readouterr().out.splitlines())


def test_print_config_shows_wsd_and_caches_and_survives_a_device_that_cannot_start(
        tmp_path, capsys, monkeypatch):
    """The --ds-config's WSD decay, each blended folder's index cache; no compile choice where
    the device cannot start, and no cache where --data is refused (the run says why)."""
    with open(CPU_CONFIG) as f:
        config = json.load(f)
    config["scheduler"] = {"type": "WarmupStableDecayLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 1,
        "total_num_steps": 6, "decay_num_steps": 2, "decay_shape": "1-sqrt"}}
    wsd = write(tmp_path / "wsd.json", json.dumps(config))
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
    from deepspeed.accelerator import real_accelerator

    monkeypatch.setenv("DS_ACCELERATOR", "cuda")  # a CPU build of torch: CUDA cannot start
    monkeypatch.setattr(real_accelerator, "ds_accelerator", None)  # chosen again, as at a start
    with pytest.raises(SystemExit):
        load(["--data", "0.5", str(tmp_path / "a"), "0.5", str(tmp_path / "b"), "--out", "o",
              "--steps", "6", "--ds-config", wsd, "--print-config"])
    printed = capsys.readouterr().out.splitlines()
    assert f"# decay-steps = 2  # not set: the --ds-config's, {wsd}" in printed
    assert f'# decay-shape = "1-sqrt"  # not set: the --ds-config\'s, {wsd}' in printed
    assert f'# index-cache = ["{tmp_path / "a"}", "{tmp_path / "b"}"]  # not set: each --data ' \
           "folder where this process may write, else OUT/index-cache" in printed
    assert "# compile = (not set)  # default" in printed
    with pytest.raises(SystemExit) as exit_:  # a --data the run refuses: said by the run
        load(["--data", "wiki=", "--out", "o", "--steps", "6", "--print-config"])
    assert exit_.value.code == 0 and "# index-cache = (not set)  # default" in \
        capsys.readouterr().out.splitlines()


def test_print_config_shows_the_positional_arguments_as_comments(tmp_path, capsys):
    """They are no keys of a --config file: the printed file still reads back."""
    from tupe_ds.export.write import main as export_main

    for argv, line in ((["RUN/checkpoints", "--out", "x"],
                        '# checkpoint = "RUN/checkpoints"  # command line (an argument: no key '
                        'of a --config file)'),
                       (["--out", "x"], "# checkpoint = (not given)  # an argument of the command "
                                        "line")):
        with pytest.raises(SystemExit):
            export_main([*argv, "--print-config"])
        printed = capsys.readouterr().out
        assert line in printed.splitlines()
    with pytest.raises(SystemExit) as exit_:
        export_main(["--config", write(tmp_path / "e.toml", printed), "--print-config"])
    assert exit_.value.code == 0
    capsys.readouterr()
    with pytest.raises(SystemExit):  # a name of bytes that are no UTF-8: escaped, as a comment
        export_main(["RUN\udcff", "--out", "x", "--print-config"])
    printed = capsys.readouterr().out
    assert '# checkpoint = "RUN\\udcff"  # command line' in printed
    with pytest.raises(SystemExit) as exit_:
        export_main(["--config", write(tmp_path / "f.toml", printed), "--print-config"])
    assert exit_.value.code == 0


def test_print_config_works_without_the_required_settings_and_shows_the_tasks_values(capsys):
    from tupe_ds.finetune.run import given_by_task, parser

    with pytest.raises(SystemExit) as exit_:
        pretrain_args(["--steps", "7", "--print-config"])
    assert exit_.value.code == 0
    printed = capsys.readouterr().out.splitlines()
    assert "# data = (not set)  # required: give it" in printed and "steps = 7  # command line" \
        in printed
    with pytest.raises(SystemExit) as exit_:
        command_line.parse(parser(), ["--task", "mnli", "--print-config"], unset=given_by_task)
    assert exit_.value.code == 0
    printed = capsys.readouterr().out.splitlines()
    assert "# model = (not set)  # required: give it" in printed
    assert "# epochs = 5  # not set: the paper's for mnli" in printed
    assert "# global-batch-size = 32  # not set: the paper's" in printed
    with pytest.raises(SystemExit) as exit_:  # without --print-config they are still required
        command_line.parse(parser(), ["--task", "mnli"])
    assert exit_.value.code == 2 and "the following arguments are required: --model" in \
        capsys.readouterr().err


@pytest.mark.parametrize("command, argv, line", [
    ("tupe_ds.export.write", [], '# out = (not set)  # required: give it'),
    ("data_prep.cli", ["merge"], "quiet = false  # default"),
])
def test_print_config_works_without_the_positional_arguments(capsys, command, argv, line):
    """tupe-export's CHECKPOINT and tupe-prep merge's SHARD_DIRs: not settings, not needed to
    print them; still required without --print-config."""
    main = __import__(command, fromlist=["main"]).main
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--print-config"])
    assert exit_.value.code == 0
    assert line in capsys.readouterr().out.splitlines()
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert "the following arguments are required" in capsys.readouterr().err


def test_tupe_preps_printed_config_reads_back_though_a_flag_of_one_or_more_is_unset(tmp_path,
                                                                                   capsys):
    """--dedup-against takes one folder or more: unset, it is printed as a comment, not as an
    empty list that --config refuses."""
    from data_prep.cli import main

    with pytest.raises(SystemExit):
        main(["--shard", "1/4", "--print-config"])
    printed = capsys.readouterr().out
    assert "# dedup-against = (not set)  # default" in printed.splitlines()
    assert 'shard = "1/4"  # command line' in printed.splitlines()  # as --shard takes it
    with pytest.raises(SystemExit) as exit_:
        main(["--config", write(tmp_path / "prep.toml", printed), "--print-config"])
    assert exit_.value.code == 0, capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--config", write(tmp_path / "list.toml", "shard = [1, 4]\n")])
    assert 'shard = [1, 4]: give one value (this flag takes several in one: "1/4")' in \
        capsys.readouterr().err


def test_compare_prints_and_reads_the_flags_it_passes_to_tupe_pretrain(tmp_path, capsys):
    """tupe-compare's unknown flags go to every run: --print-config lists them as pretrain-flags,
    a file's come first, the command line's after (so they win)."""
    from tupe_ds.compare import cli
    from tupe_ds.compare.plan import Plan
    from tupe_ds.tools.errors import CompareError

    argv = ["plan", "--data", "d", "--encodings", "rope", "--steps", "4", "--model", "tiny",
            "--out", "o"]
    with pytest.raises(SystemExit):
        cli.main([*argv, "--lr", "1e-3", "--seq-len", "64", "--print-config"])
    printed = capsys.readouterr().out
    assert 'pretrain-flags = ["--lr", "1e-3", "--seq-len", "64"]  # command line' in printed
    config = write(tmp_path / "c.toml", printed)
    with pytest.raises(SystemExit):
        cli.main(["plan", "--config", config, "--lr", "2e-3", "--print-config"])
    assert (f'pretrain-flags = ["--seq-len", "64", "--lr", "2e-3"]  # {config}, then the '
            "command line") in capsys.readouterr().out.splitlines()  # the command line's --lr
    with pytest.raises(SystemExit):  # the printed file with the same command: the same flags
        cli.main([*argv, "--lr", "1e-3", "--seq-len", "64", "--config", config, "--print-config"])
    assert 'pretrain-flags = ["--lr", "1e-3", "--seq-len", "64"]' in capsys.readouterr().out
    (tmp_path / "cfg").mkdir()
    config = write(tmp_path / "cfg" / "lr.toml", 'pretrain-flags = ["--lr", "-.001", "--bf16"]\n')
    with pytest.raises(SystemExit):  # a negative value is the flag's, not a flag
        cli.main([*argv, "--config", config, "--lr", "1e-3", "--print-config"])
    assert 'pretrain-flags = ["--bf16", "--lr", "1e-3"]' in capsys.readouterr().out
    config = write(tmp_path / "cfg" / "odd.toml", 'pretrain-flags = ["--bf16", true]\n')
    with pytest.raises(SystemExit):
        cli.main([*argv, "--config", config, "--print-config"])
    assert "pretrain-flags = True: give each flag and each value as a string" in \
        capsys.readouterr().err
    config = write(tmp_path / "cfg" / "c.toml", 'pretrain-flags = ["--ds-config", "ds.json", '
                   '"--seq-len", "64", "--init-from=../runs/p1"]\n')
    with pytest.raises(SystemExit):  # its paths are the file's; a Megatron name is the setting
        cli.main([*argv, "--config", config, "--seq-length", "128", "--print-config"])
    assert (f'pretrain-flags = ["--ds-config", "{tmp_path}/cfg/ds.json", "--init-from='
            f'{tmp_path}/runs/p1", "--seq-length", "128"]') in capsys.readouterr().out
    for flag in ("--print-config", "--help", "--train-iters=3", "--config", "--model"):
        with pytest.raises(CompareError, match=f"^{flag.split('=')[0]}"):
            Plan(out="o", data=("d",), encodings=("rope",), seeds=(1,), steps=4, baseline="rope",
                 processes=1, pretrain_flags=("--model", "tiny", flag)).check_flags()


def test_shape_flags_change_the_preset_and_are_checked(data, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    common = ["--data", data, "--ds-config", CPU_CONFIG, "--steps", "2", "--seq-len", "64"]
    run = load([*common, "--out", str(tmp_path / "a"), "--model", "tiny", "--num-layers", "3",
                "--hidden-size", "96", "--num-attention-heads", "6", "--ffn-hidden-size", "200"])
    model = run.models[0]
    assert (model.num_layers, model.hidden_size, model.num_attention_heads,
            model.ffn_hidden_size) == (3, 96, 6, 200)
    assert run.identity["models"][0]["num_layers"] == 3  # a resume with another is refused
    for extra, said in [(["--num-layers", "0"], "--num-layers must be at least 1"),
                        (["--objective", "electra", "--hidden-size", "32"],
                         "--hidden-size: the model shape flags change a BERT preset"),
                        (["--hidden-size", "65"], "65"),
                        (["--ffn-hidden-size", "33", "--tp", "2"], "33 cannot be split over")]:
        monkeypatch.setenv("WORLD_SIZE", "2" if "--tp" in extra else "1")
        with pytest.raises(Refused) as error:
            load([*common, "--out", str(tmp_path / "b"), "--model", "tiny", *extra])
        assert said in str(error.value), str(error.value)


def test_decay_shape_without_wsd_is_refused(data, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(Refused) as error:
        load(["--data", data, "--ds-config", CPU_CONFIG, "--steps", "2", "--model", "tiny",
              "--out", str(tmp_path / "run"), "--decay-shape", "1-sqrt"])
    assert "--decay-shape is --lr-schedule wsd's: add --lr-schedule wsd --decay-steps N" in \
        str(error.value)


def test_recorded_settings_are_absolute_and_one_shot_flags_are_not_recorded(tmp_path,
                                                                            monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = pretrain_args(["--data", "0.7", "wiki=prep/wiki", "0.3", "prep/books/merged",
                          "--ds-config", "c.json", "--out", "run", "--steps", "3",
                          "--fresh-start", "--resume-from", "step2", "--mask-split", "0.7,0.2"])
    settings = recorded_settings.recordable(args)
    assert settings["data"] == ["0.7", f"wiki={tmp_path}/prep/wiki", "0.3",
                                f"{tmp_path}/prep/books/merged"]
    assert settings["ds_config"] == f"{tmp_path}/c.json" and settings["out"] == f"{tmp_path}/run"
    assert not set(recorded_settings.ONE_SHOT) & set(settings)
    os.makedirs("run")
    history.append("run", [], [history.record("attempt", lineage="L",
                                              settings=json.loads(json.dumps(settings)))])
    monkeypatch.chdir(tmp_path / "run")  # elsewhere: the paths still name the same folders
    again = command_line.parse(flags.parser(), ["--out", str(tmp_path / "run"), "--steps", "5"],
                               recorded=recorded_settings.of_run_folder)
    assert again.steps == 5 and again.mask_split == (0.7, 0.2)
    assert again.data == settings["data"] and again.ds_config == settings["ds_config"]
    assert not again.fresh_start and again.resume_from is None
    # a command that gives what a run needs still takes the rest from the run
    complete = command_line.parse(flags.parser(), ["--out", str(tmp_path / "run"), "--data", "d",
                                                   "--ds-config", "c", "--steps", "5"],
                                  recorded=recorded_settings.of_run_folder)
    assert complete.mask_split == (0.7, 0.2) and complete.data == ["d"]


def test_a_recorded_value_this_version_refuses_is_overridden_by_the_command(tmp_path, capsys):
    """A history holding values no flag takes (written by hand, or by another version) does not
    lock the run: the command's own value is taken, and without one the refusal names every
    such value and how to give each anew."""
    os.makedirs(tmp_path / "run")
    history.append(str(tmp_path / "run"), [], [history.record("attempt", lineage="L", settings={
        "lr_schedule": "constant", "bf16": "yes", "steps": 3})])
    argv = ["--out", str(tmp_path / "run"), "--data", "d", "--ds-config", "c"]
    args = command_line.parse(flags.parser(), [*argv, "--lr-decay-style", "wsd", "--bf16"],
                              recorded=recorded_settings.of_run_folder)
    assert args.lr_schedule == "wsd" and args.bf16 and args.steps == 3
    with pytest.raises(SystemExit):
        command_line.parse(flags.parser(), argv, recorded=recorded_settings.of_run_folder)
    said = capsys.readouterr().err
    assert "lr_schedule = 'constant': choose one of" in said and "bf16 = 'yes': give true" in said
    assert "; give bf16 = true or false in a --config file, --lr-schedule to set them anew" in said


def test_config_paths_expand_variables_and_print_config_stays_toml(tmp_path, monkeypatch,
                                                                   capsys):
    """$VARIABLES in a file's paths expand as ~ does (one not set is refused), not a command
    line's (the shell's); --print-config of a name TOML cannot hold (bytes that are no UTF-8,
    DEL, in a value or in a comment's file name) is still a TOML file."""
    import tomllib

    monkeypatch.setenv("TUPE_TEST_RUNS", str(tmp_path / "runs"))
    required = ["--data", "d", "--ds-config", "c", "--steps", "3"]
    config = write(tmp_path / "c.toml", 'out = "${TUPE_TEST_RUNS}/large"\n')
    assert pretrain_args(["--config", config, *required]).out == str(tmp_path / "runs" / "large")
    with pytest.raises(SystemExit):
        pretrain_args(["--config", write(tmp_path / "u.toml", 'out = "$TUPE_UNSET/x"\n'),
                       *required])
    assert "$TUPE_UNSET is not set in the environment" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pretrain_args(["--out", "runs/$HOME", *required, "--print-config"])
    assert f'out = "{os.path.abspath("runs/$HOME")}"  # command line' in capsys.readouterr().out
    odd_folder = tmp_path / os.fsdecode(b"cfg-\xff\x7f")
    odd_folder.mkdir()
    config = write(odd_folder / "c.toml", 'steps = 3\n')
    odd = os.fsdecode(b"/tmp/run-\xff") + "\x7f"
    with pytest.raises(SystemExit):
        pretrain_args(["--out", odd, "--data", "/tmp/del\x7f", "--config", config,
                       "--print-config"])
    printed = capsys.readouterr().out
    settings = tomllib.loads(printed.encode().decode())
    assert settings["data"] == ["/tmp/del\x7f"] and settings["steps"] == 3
    assert "out" not in settings and "# out = (bytes that are not UTF-8 text" in printed


@pytest.mark.slow
def test_tupe_pretrain_print_config_is_printed_before_any_work(tmp_path):
    result = subprocess.run([sys.executable, "-m", "tupe_ds.pretrain", "--out", str(tmp_path),
                             "--print-config"], capture_output=True, text=True, timeout=120,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "# data = (not set)  # required: give it" in result.stdout.splitlines()
    assert os.listdir(tmp_path) == []  # no lock, no history, no log


@pytest.mark.parametrize("command, argv, line", [
    ("data_prep.cli", ["--input", "a", "--vocab-size", "100"], "vocab-size = 100  # command line"),
    ("data_prep.cli", ["merge", "s1", "--output", "m"],  # a path printed absolute
     f'out = "{os.path.abspath("m")}"  # command line'),
    ("tupe_ds.export.write", ["RUN", "--out", "x"], 'format = "hf"  # default'),
    ("tupe_ds.machine.doctor", ["--nproc", "2"], "nproc = 2  # command line"),
    ("tupe_ds.machine.smoke", ["--steps", "3"], "steps = 3  # command line"),
    ("tupe_ds.finetune.run", ["--model", "m", "--task", "rte", "--train", "t", "--valid", "v",
                              "--out", "o", "--seeds", "1,2", "3"],
     "seeds = [1, 2, 3]  # command line"),
    ("tupe_ds.compare.cli", ["plan", "--data", "d", "--encodings", "rope", "bert-a", "--steps",
                             "4", "--model", "tiny", "--out", "o", "--lr", "1e-3"],
     'encodings = ["rope", "bert-a"]  # command line'),
])
def test_every_command_takes_a_config_file_and_prints_its_settings(tmp_path, capsys, command,
                                                                   argv, line):
    """The file's setting under the command line's (prep's --out from the file), printed."""
    main = __import__(command, fromlist=["main"]).main
    config = write(tmp_path / "c.toml", 'out = "from-file"\nquiet = true\n'
                   if command == "data_prep.cli" else "")
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--config", config, "--print-config"])
    assert exit_.value.code == 0
    printed = capsys.readouterr().out.splitlines()
    assert line in printed, printed
    if command == "data_prep.cli":
        assert f"quiet = true  # {config}" in printed
