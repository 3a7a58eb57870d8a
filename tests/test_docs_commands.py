"""Every command example of the docs (README.md, docs/*.md) that runs a tupe_ds command is read by
that command's own parser, and tupe-pretrain's also pass the checks that read no data or run
folder: a flag that does not exist, a bad value or a batch split the run would refuse fails the
test of that example, named FILE:LINE.

What is an example: a line of a ```sh, ```bash, ```shell, ```console or unlabelled block (a line
ending in `\\` joined to the next, a `$ ` prompt and comments dropped) that runs tupe-pretrain,
tupe-prep, tupe-export, tupe-finetune, tupe-compare, tupe-doctor or tupe-smoke (setup.cfg's
console scripts), `python -m` a module of tupe_ds or data_prep, either under deepspeed,
torchrun, srun or mpirun, or `sbatch slurm/X.sbatch` (the script run by bash with a stand-in
python that prints the commands it is given).
- `...` stands for the flags of the page's first complete example (one without `...`) of the
  same command, or, where it follows the launcher, of the same launcher: as a reader fills it in.
  Where the page has none, what is given is parsed, no flag required.
- `[--flag V]` is optional: parsed, a placeholder such as N standing for its value, and left
  out of the checks beyond parsing.
- The processes: the launcher's (--num_gpus x --num_nodes, --nproc_per_node x --nnodes, -np,
  --ntasks, sbatch's --nodes x --ntasks-per-node, the script's #SBATCH lines overridden), one
  without a launcher, on nodes of 8 H100 GPUs. A launcher that does not say (all the GPUs of the
  node) gets the checks of the flags alone.
- tupe-compare run and plan: its parser, then every run's tupe-pretrain flags as it plans them,
  less what it reads from files (the tasks in --finetune's folder, --recipe modern's flags).
Not read: scripts that make the command themselves (slurm/submit_*.sh, make targets: run in
test_slurm.py, test_docs.py and test_compare.py) and commands quoted in the prose.
"""

import argparse
import contextlib
import configparser
import contextlib
import dataclasses
import importlib
import io
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from tupe_ds.compare.cli import FINETUNE_FLAGS, make_plan, plan_parser
from tupe_ds.compare.recipes import given
from tupe_ds.machine import doctor
from tupe_ds.tools import command_line
from tupe_ds.tools.errors import CompareError, Refused
from tupe_ds.train import config, flags, nonfinite
from tupe_ds.train.ds_config import deepspeed_config

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCKS = ("", "sh", "bash", "shell", "console")
FENCE = re.compile(r"\s*```\s*(\w*)\s*$")
PACKAGES = ("tupe_ds", "data_prep")
# launcher: (the flags that give its processes per node, those that give its nodes)
PROCESS_FLAGS = {"deepspeed": (("--num_gpus",), ("--num_nodes",)),
                 "torchrun": (("--nproc_per_node", "--nproc-per-node"), ("--nnodes",)),
                 "mpirun": (("-np", "-n"), ()),
                 "srun": (("--ntasks", "-n"), ()),
                 "sbatch": (("--ntasks-per-node",), ("--nodes", "-N"))}
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*")  # N, STEPS: a value the reader chooses
DOCS_NODE = doctor.Machine(accelerator="cuda", gpus=8, capabilities=((9, 0),) * 8)
PARSE_ARGS = argparse.ArgumentParser.parse_args  # the real one: main()'s is stopped after it


def console_scripts() -> dict:
    """{tupe-prep: data_prep.cli:main, ...} from setup.cfg."""
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    lines = setup["options.entry_points"]["console_scripts"].strip().splitlines()
    return dict((part.strip() for part in line.split("=")) for line in lines)


CONSOLE_SCRIPTS = console_scripts()
# the first word of a command that runs one of tupe_ds: a launcher, python, a console script
STARTS = re.compile("|".join([*PROCESS_FLAGS, r"python[\d.]*", *CONSOLE_SCRIPTS]))


@dataclasses.dataclass(frozen=True)
class Example:
    page: str  # relative to the repository
    line: int
    text: str  # as written, its lines joined
    words: tuple  # as the shell splits it, without prompt and comment

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


@dataclasses.dataclass(frozen=True)
class Invocation:
    launcher: tuple  # the words before the program: deepspeed --num_gpus 8, mpirun -np 8 python
    program: str  # a console script, a module or an sbatch script
    args: tuple
    processes: Optional[int]  # None: the launcher does not say
    elided: bool = False  # flags left out with `...` that the page does not show

    @property
    def module(self) -> str:
        """tupe-prep: data_prep.cli; a module or a script as it is."""
        return CONSOLE_SCRIPTS.get(self.program, self.program).split(":")[0]


def command_lines(block: list) -> list:
    """(line offset, text) of each command of a block's lines: continuations joined."""
    commands, start, pending = [], None, ""
    for offset, line in enumerate(block):
        text = line.strip()
        if text.startswith("$ "):
            text = text[2:]
        start = offset if not pending else start
        if text.endswith("\\"):
            pending += text[:-1].rstrip() + " "
            continue
        commands.append((start, pending + text))
        pending = ""
    return commands


def program_of(words: list) -> Optional[tuple]:
    """(launcher words, program, its arguments), or None where no tupe_ds command runs: a
    console script, the module after -m or --module, the script after sbatch."""
    for i, word in enumerate(words):
        if os.path.basename(word) in CONSOLE_SCRIPTS:
            return tuple(words[:i]), os.path.basename(word), tuple(words[i + 1:])
        if (word in ("-m", "--module") and i + 1 < len(words)
                and words[i + 1].split(".")[0] in PACKAGES):
            return tuple(words[:i]), words[i + 1], tuple(words[i + 2:])
        if words[0] == "sbatch" and word.endswith(".sbatch"):
            return tuple(words[:i]), word, tuple(words[i + 1:])
    return None


def before_elision(words: tuple) -> list:
    return list(words[:words.index("...")]) if "..." in words else list(words)


def shell_blocks(page: Path) -> list:
    """(line number of its first line, its lines) of each shell or unlabelled block."""
    blocks, language, lines = [], None, []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        fence = FENCE.match(line)
        if fence and language is None:
            language, start, lines = fence.group(1), number + 1, []
        elif fence:
            if language in SHELL_BLOCKS:
                blocks.append((start, lines))
            language = None
        elif language is not None:
            lines.append(line)
    return blocks


def page_examples(page: Path) -> list:
    examples = []
    for start, block in shell_blocks(page):
        for offset, text in command_lines(block):
            try:
                words = shlex.split(text, comments=True)
            except ValueError:  # unbalanced quotes: output, not a command
                continue
            while words and (words[0] == "env" or re.match(r"\w+=", words[0])):
                words = words[1:]
            if words and STARTS.fullmatch(os.path.basename(words[0])) and (
                    program_of(before_elision(words)) or "..." in words):
                examples.append(Example(str(page.relative_to(ROOT)), start + offset,
                                        text.split(" #")[0].strip(), tuple(words)))
    return examples


EXAMPLES = [example for page in PAGES for example in page_examples(page)]


def flag_value(words: tuple, names: tuple) -> Optional[str]:
    """The value of the first of `names` given (NAME VALUE or NAME=VALUE, the last one)."""
    return next((value for value in (given(words, name) for name in names) if value), None)


def process_count(launcher: tuple) -> Optional[int]:
    """The processes a launcher starts; 1 without one (python, a console script)."""
    name = os.path.basename(launcher[0]) if launcher else ""
    if name not in PROCESS_FLAGS:
        return 1
    per_node_flags, node_flags = PROCESS_FLAGS[name]
    per_node, nodes = flag_value(launcher, per_node_flags), flag_value(launcher, node_flags) or "1"
    if not (per_node and per_node.isdigit() and nodes.isdigit()):  # or a range: --nnodes 1:4
        return None
    return int(per_node) * int(nodes)


def without_optional(words: tuple) -> tuple:
    """`words` less their [optional] groups."""
    kept, depth = [], 0
    for word in words:
        depth += len(word) - len(word.lstrip("["))
        if not depth:
            kept.append(word)
        depth -= len(word) - len(word.rstrip("]"))
    return tuple(kept)


def with_optional(words: tuple) -> tuple:
    return tuple(word.lstrip("[").rstrip("]") for word in words)


def invocation(launcher: tuple, program: str, args: tuple, elided: bool = False) -> Invocation:
    return Invocation(launcher, program, args, process_count(launcher), elided)


def complete(example: Example) -> Optional[Invocation]:
    split = program_of(list(example.words)) if "..." not in example.words else None
    return invocation(*split) if split else None


def resolve(example: Example) -> Invocation | str:
    """What `example` runs, its `...` filled in from the page; a string says why it cannot be
    told."""
    if "..." not in example.words:
        return complete(example)
    given_after = tuple(word for word in example.words[example.words.index("..."):]
                        if word != "...")
    shown = [complete(other) for other in EXAMPLES if other.page == example.page]
    split = program_of(before_elision(example.words))
    if split:  # the program's flags elided
        launcher, program, given_before = split
        module = invocation(launcher, program, ()).module
        base = next((run for run in shown if run and run.module == module), None)
        if base is None:
            return invocation(launcher, program, given_before + given_after, elided=True)
        return invocation(launcher, program,
                          without_optional(base.args) + given_before + given_after)
    launcher = before_elision(example.words)  # the program elided too, its launcher shown
    base = next((run for run in shown if run and run.launcher[:1] == (launcher[0],)), None)
    if base is None:
        return (f"what `{launcher[0]} ...` runs: the page shows no complete {launcher[0]} "
                "command to fill it in from")
    return invocation(base.launcher + tuple(launcher[1:]), base.program,
                      without_optional(base.args) + given_after)


class Parsed(Exception):
    """Raised in place of the rest of a command's main(), once its parser has read the argv."""


def parse(parser: argparse.ArgumentParser, argv, parse_only: bool, known: bool = False):
    """`parser`'s reading of argv. parse_only: none of its flags required (the example leaves
    some out, or shows them apart) and a placeholder (N) taken as written for its flag."""
    if parse_only:
        flag, placeheld = None, set()
        for word in argv:
            flag = word if word.startswith("-") else flag
            if flag and PLACEHOLDER.fullmatch(word):
                placeheld.add(flag)
        for action in parser._actions:
            action.required = False
            if placeheld & set(action.option_strings):
                action.type = None
    return parser.parse_known_args(argv) if known else PARSE_ARGS(parser, argv)


def check_pretrain(argv, processes: Optional[int], parse_only: bool) -> None:
    """tupe-pretrain's parser, its flag checks, and load()'s checks that read no data or run
    folder: the layout, the DeepSpeed config with the command's batch (ramp included) and
    schedule on nodes of DOCS_NODE, the model configs."""
    argv = [word for word in argv if word != "--print-config"]  # it prints and exits
    if "--out" in argv and not {"--data", "--data-path", "--config"} & set(argv):
        parse_only = True  # a resume: the rest is the run's own, from OUT/run.json
    if parse_only:
        parse(flags.parser(), argv, parse_only)
        return
    with contextlib.chdir(ROOT):  # a --config file of the repository
        args = command_line.parse(flags.parser(), argv)
    flags.check_flags(args)
    if processes is None:
        return
    layout = config.process_layout(args, processes)
    ds_config, dtype, _, _ = deepspeed_config(args, layout.dp, DOCS_NODE)
    problem = nonfinite.config_problem(ds_config, dtype)
    if problem:
        flags.fail(problem)
    zero_stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    config.model_configs(args, dtype, 128 * args.tp, zero_stage)  # any padded vocabulary


def check_compare(args: tuple, parse_only: bool) -> None:
    command, rest = (args[0], list(args[1:])) if args else ("", [])
    if command not in ("run", "plan"):
        pytest.skip(f"tupe-compare {command}: its main() reads these arguments without a parser")
    compare_args, pretrain_flags = parse(plan_parser(f"tupe-compare {command}", ""), rest,
                                         parse_only, known=True)
    if parse_only:
        parse(flags.parser(), pretrain_flags, parse_only)
        return
    # the plan less what tupe-compare reads from files: --finetune's tasks, the modern recipe
    # (scaled to the first run's data)
    from_command = argparse.Namespace(**{**vars(compare_args), "finetune": None, "tasks": None,
                                         **dict.fromkeys(FINETUNE_FLAGS), "recipe": "paper"})
    plan = make_plan(from_command, pretrain_flags)
    plan.check_flags()
    for run in plan.runs:
        check_pretrain(plan.pretrain_argv(run), plan.processes, parse_only)


def parse_as_main(run: Invocation, parse_only: bool, monkeypatch) -> None:
    """The command's main() up to its parse_args, which reads the arguments and stops it."""
    def parse_and_stop(parser, args=None, namespace=None):
        raise Parsed(parse(parser, args, parse_only))

    with monkeypatch.context() as patch, pytest.raises(Parsed):
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
        if run.program in CONSOLE_SCRIPTS:
            module, function = CONSOLE_SCRIPTS[run.program].split(":")
            getattr(importlib.import_module(module), function)(list(run.args))
        else:  # python -m MODULE, as the interpreter runs it
            patch.setattr(sys, "argv", [run.program, *run.args])
            runpy.run_module(run.program, run_name="__main__", alter_sys=True)


def sbatch_runs(run: Invocation, stand_ins: Path) -> list:
    """The tupe_ds commands the batch script runs, with its job's processes: the script run by
    bash with a python that prints its arguments, and an srun that does nothing."""
    (stand_ins / "python").write_text("#!/usr/bin/env python3\nimport json, sys\n"
                                      "print(json.dumps(sys.argv[1:]))\n")
    (stand_ins / "srun").write_text("#!/bin/sh\n")
    for program in ("python", "srun"):
        (stand_ins / program).chmod(0o755)
    environment = {name: value for name, value in os.environ.items()
                   if not name.startswith("SLURM_")}
    environment.update(PATH=f"{stand_ins}:{os.environ['PATH']}", PYTHON="python",
                       TUPE_DS_ROOT=str(ROOT))
    script = ROOT / run.program
    ran = subprocess.run(["bash", str(script), *run.args], env=environment, cwd=stand_ins,
                         capture_output=True, text=True, timeout=60)
    if ran.returncode:
        raise SystemExit(f"{run.program} exited {ran.returncode}: {ran.stderr.strip()}")
    job = [word for line in re.findall(r"^#SBATCH (.*)$", script.read_text(), re.M)
           for word in line.split()]
    processes = process_count(("sbatch", *job, *run.launcher[1:]))
    commands = [json.loads(line) for line in ran.stdout.splitlines() if line.startswith("[")]
    runs = [Invocation(("python",), argv[1], tuple(argv[2:]), processes)
            for argv in commands if argv[:1] == ["-m"] and argv[1].split(".")[0] in PACKAGES]
    if not runs:
        pytest.skip(f"{run.program} ran no tupe_ds command with a stand-in python")
    return runs


def check(run: Invocation, parse_only: bool, monkeypatch, tmp_path) -> None:
    if run.program.endswith(".sbatch"):
        for inner in sbatch_runs(run, tmp_path):
            check(inner, parse_only, monkeypatch, tmp_path)
    elif run.module == "tupe_ds.pretrain":
        check_pretrain(list(run.args), run.processes, parse_only)
    elif run.module == "tupe_ds.compare.cli":
        check_compare(run.args, parse_only)
    else:
        parse_as_main(run, parse_only, monkeypatch)


def refusal(check) -> Optional[str]:
    """What refuses `check()`: argparse's message, a check's, tupe-compare's; None if nothing."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            check()
    except SystemExit as refused:
        if refused.code in (0, None):  # --help, --print-config: the command ends there, content
            return None
        return (said.getvalue().strip().splitlines() or [f"exit {refused.code}"])[-1]
    except Refused as refused:  # flags.fail's
        return f"tupe-pretrain: error: {refused}"
    except CompareError as refused:
        return str(refused)
    return None


def test_the_extraction_finds_the_examples():
    """The commands the docs' blocks show, each found: fences or an extraction that would leave
    them unchecked fail here."""
    found = {resolved.module for resolved in map(resolve, EXAMPLES) if
             isinstance(resolved, Invocation)}
    assert {"tupe_ds.pretrain", "data_prep.cli", "tupe_ds.export.write",
            "tupe_ds.finetune.run", "tupe_ds.compare.cli", "tupe_ds.machine.doctor",
            "slurm/pretrain.sbatch"} <= found, found


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # runpy's, of -m
@pytest.mark.parametrize("example", EXAMPLES, ids=str)
def test_doc_example_is_accepted(example, monkeypatch, tmp_path):
    run = resolve(example)
    if isinstance(run, str):
        pytest.skip(run)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # this machine's locks: not docs'

    def checks():
        if with_optional(run.args) != run.args:
            check(dataclasses.replace(run, args=with_optional(run.args)), True, monkeypatch,
                  tmp_path)
        check(dataclasses.replace(run, args=without_optional(run.args)), run.elided,
              monkeypatch, tmp_path)

    refused = refusal(checks)
    if refused is not None:
        pytest.fail(f"{example}: {example.text}\n{refused}", pytrace=False)
