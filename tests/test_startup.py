"""A command's start (tupe_ds/tools/startup.py). The collector paused while its libraries
import: every console script is a command whose main() (tools/entry.py) resumes it; a command
started either way pauses and resumes; a program importing tupe_ds keeps its collector;
TUPE_DS_GC=on leaves it alone. The libraries' torch.compile decorations compiled at first call:
a run that compiles nothing imports no inductor; TUPE_DS_COMPILE_AT_IMPORT=on keeps them as the
libraries make them. A run trains the same either way."""

import ast
import configparser
import importlib
import inspect
import json
import os
import subprocess
import sys

import pytest

from runs import ROOT, environment, losses
from tupe_ds.tools import entry
from tupe_ds.tools.startup import COMMANDS

PROBE = """
import gc, json, runpy, sys
how, module, script, *given = sys.argv[1:]
seen = {}
if how == "console script":  # as the script pip writes: import, then main()
    sys.argv = ["/venv/bin/" + script, *given]
    command = __import__(module, fromlist=["main"])
    seen["import"] = [gc.isenabled(), gc.get_freeze_count()]
    run = command.main
else:  # python -m MODULE ...
    sys.argv = [module, *given]
    run = lambda: runpy.run_module(module, run_name="__main__", alter_sys=True)
try:
    run()
except SystemExit:
    pass
seen["main"] = [gc.isenabled(), gc.get_freeze_count()]
jit = sys.modules.get("megatron.core.jit")
seen["compiler"] = ["torch._inductor.compile_fx" in sys.modules, jit and jit.jit_fuser.__name__]
print(json.dumps(seen))
"""


def probe(how, module, script, *given, gc_setting="", compile_setting=""):
    """The collector's state (enabled, frozen count) after the import ("console script" only)
    and after main, and after main whether inductor's compiler was imported and what
    megatron-core's jit_fuser is, in a process that runs `module` as `how` with the arguments
    `given`."""
    result = subprocess.run([sys.executable, "-c", PROBE, how, module, script, *given],
                            capture_output=True, text=True, timeout=300,
                            env={**environment(), "TUPE_DS_GC": gc_setting,
                                 "TUPE_DS_COMPILE_AT_IMPORT": compile_setting})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def console_scripts():
    config = configparser.ConfigParser()
    config.read(os.path.join(ROOT, "setup.cfg"))
    entries = config["options.entry_points"]["console_scripts"].strip().splitlines()
    return dict(entry.replace(" ", "").split("=") for entry in entries)


def test_every_console_script_is_a_command_whose_main_resumes_the_collector():
    scripts = console_scripts()
    assert {name: target for name, target in scripts.items()} == {
        name: f"{module}:main" for module, name in COMMANDS.items() if name}
    for module in COMMANDS:  # main() is entry.run's, which resumes it before the command's work
        main = importlib.import_module(module).main
        first = ast.parse(inspect.getsource(main)).body[0].body[0]
        assert ast.unparse(first).startswith("return entry.run("), module
    first = ast.parse(inspect.getsource(entry.run)).body[0].body
    assert ast.unparse(first[1]) == "startup.resume_collector()"  # after its docstring


@pytest.fixture(scope="module")
def trained_runs(data, tmp_path_factory):
    """`python -m tupe_ds.pretrain` training 3 steps as a command starts ("") and as the
    references do ("on": the collector on, the libraries' compiles decorated at import), each
    process a probe as well: {setting: (the probe's states, the run's losses)}. A process's
    start costs more than its training: one run serves several tests."""
    runs = {}
    for gc_setting in ("", "on"):
        out = tmp_path_factory.mktemp(gc_setting or "paused")
        seen = probe("python -m", "tupe_ds.pretrain", "tupe-pretrain", "--data", data, "--model",
                     "tiny", "--ds-config", os.path.join(ROOT, "ds_configs", "cpu_zero2.json"),
                     "--out", str(out), "--seq-len", "64", "--steps", "3", "--global-batch",
                     "8", "--log-interval", "1", "--eval-samples", "16", "--dropout", "0",
                     gc_setting=gc_setting, compile_setting=gc_setting)
        runs[gc_setting] = seen, losses(out)
    return runs


@pytest.mark.parametrize("how", ["console script", "python -m"])
@pytest.mark.slow
def test_a_command_pauses_the_collector_while_it_imports_and_resumes_it_in_main(how, request):
    if how == "console script":
        seen = probe(how, "tupe_ds.pretrain", "tupe-pretrain", "--help")
        assert seen["import"] == [False, 0]  # paused, nothing frozen yet
        reference = probe(how, "tupe_ds.pretrain", "tupe-pretrain", "--help",
                          gc_setting="True")
    else:  # a training run's process: its main() as --help's, then training
        runs = request.getfixturevalue("trained_runs")
        seen, reference = runs[""][0], runs["on"][0]
    enabled, frozen = seen["main"]
    assert enabled and frozen > 100_000  # torch, DeepSpeed and megatron-core's objects
    assert reference["main"] == [True, 0] and reference.get("import", [True, 0]) == [True, 0]


@pytest.mark.slow
def test_a_program_that_imports_tupe_ds_keeps_its_collector(imported_first):
    """FIRST_IMPORTS's first line: a program whose first import is tupe_ds.pretrain."""
    first = imported_first.stdout.split("\n")[0]
    assert first.split() == ["True", "0"], imported_first.stderr[-2000:]


@pytest.mark.slow
def test_a_run_that_compiles_nothing_imports_no_compiler(trained_runs):
    """The run compiles nothing (the CPU default): megatron-core's fused functions and
    DeepSpeed's Muon, which its ZeRO imports, wait for a first call to compile, so inductor's
    compiler (a second of CPU) is never imported; with TUPE_DS_COMPILE_AT_IMPORT=on it is, by
    their torch.compile decorations, as without tupe_ds."""
    assert trained_runs[""][0]["compiler"] == [False, "compiled_on_first_call"]
    assert trained_runs["on"][0]["compiler"] == [True, "compile"]


@pytest.mark.slow
def test_a_run_trains_the_same_with_the_references(trained_runs):
    runs = {gc_setting: run_losses for gc_setting, (_, run_losses) in trained_runs.items()}
    assert len(runs[""]) == 3 and runs[""] == runs["on"]


def test_a_process_spawned_from_a_command_keeps_its_collector(tmp_path):
    """A worker that multiprocessing spawns (macOS's default) imports the command's script again
    but never runs its main(): its collector must not stay paused."""
    # named as the console script, doing what tupe-prep's pool would
    script = tmp_path / "tupe-prep"
    script.write_text(
        "import gc, multiprocessing, sys\n"
        "from tupe_ds.tools import startup\n"
        "def collector(_):\n"
        "    return gc.isenabled()\n"
        "if __name__ == '__main__':\n"
        "    paused = not gc.isenabled()\n"
        "    startup.resume_collector()\n"
        "    with multiprocessing.get_context('spawn').Pool(2) as pool:\n"
        "        print(paused, all(pool.map(collector, range(4))))\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=120, env=environment())
    assert result.stdout.split() == ["True", "True"], result.stderr[-3000:]


FIRST_IMPORTS = """
import gc, tupe_ds.pretrain
print(gc.isenabled(), gc.get_freeze_count())  # a program's own, not a command's
import importlib, pkgutil, sys, traceback
import tupe_ds
names = sorted(m.name for m in pkgutil.walk_packages(tupe_ds.__path__, "tupe_ds."))
failed = []
for name in names:  # each first, as a fresh interpreter would import it (the libraries stay)
    for loaded in [n for n in sys.modules if n == "tupe_ds" or n.startswith("tupe_ds.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ": " + traceback.format_exc().strip().splitlines()[-1])
print(len(names), "modules")
print("\\n".join(failed))
"""


@pytest.fixture(scope="module")
def imported_first():
    """FIRST_IMPORTS run: one process start for a program importing tupe_ds and for the imports
    of each module first (the libraries' import is most of either's cost)."""
    return subprocess.run([sys.executable, "-c", FIRST_IMPORTS], cwd=ROOT, env=environment(),
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_every_module_imports_first(imported_first):
    """A circular import shows only for some orders: each module of tupe_ds imported before any
    other of tupe_ds's (the run lock once failed so, through the checkpoint package)."""
    done = imported_first
    assert done.returncode == 0, done.stderr[-3000:]
    _, counted, *failed = done.stdout.strip().splitlines()
    assert int(counted.split()[0]) > 100 and failed == [], failed
