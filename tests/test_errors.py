"""Errors are exceptions (tupe_ds/tools/errors.py) and output goes through loggers: no module
below the commands ends the process or hands a `say` function around, and a setting read from
the environment at import never stops one."""

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (file, function): where ending the process is the point. The SIGINT handler of tupe-pretrain's
# start, and --print-config, which ends its command as argparse's --help does.
ENDS_THE_PROCESS = {("tupe_ds/pretrain.py", "interrupted_while_starting"),
                    ("tupe_ds/pretrain.py", "warned_while_starting"),
                    ("tupe_ds/tools/command_line.py", "resolve")}


def process_exits(path: str) -> list:
    """(function, line) of each `raise SystemExit` and `sys.exit(...)` outside `if __name__ ==
    "__main__":` (a package's __main__.py is an entry point whole)."""
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    found = []

    def visit(node, function):
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        exits = (isinstance(node, ast.Raise) and node.exc is not None
                 and "SystemExit" in ast.unparse(node.exc)) or (
            isinstance(node, ast.Call) and ast.unparse(node.func) in ("sys.exit", "exit"))
        if exits:
            found.append((function, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, None)
    return found


def test_no_module_below_the_commands_ends_the_process():
    modules = [os.path.relpath(os.path.join(folder, name), ROOT)
               for package in ("tupe_ds", "data_prep")
               for folder, _, names in os.walk(os.path.join(ROOT, package))
               for name in names if name.endswith(".py") and name != "__main__.py"]
    exits = [f"{path}:{line} ({function})" for path in sorted(modules)
             for function, line in process_exits(path)
             if (path, function) not in ENDS_THE_PROCESS]
    assert not exits, "raise an error of tupe_ds/tools/errors.py instead: " + ", ".join(exits)
    assert process_exits("tupe_ds/pretrain.py")  # the check sees the handler it allows


def test_a_wait_notice_that_is_no_number_is_said_and_the_default_used():
    ran = subprocess.run(
        [sys.executable, "-c", "from tupe_ds.tools import waits; print(waits.NOTICE_SECONDS)"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "TUPE_DS_WAIT_NOTICE": "soon"})
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "30.0"
    assert "TUPE_DS_WAIT_NOTICE='soon': not a number of seconds" in ran.stderr


def test_output_goes_through_loggers_not_a_say_function_handed_around():
    """tupe_ds/tools/log_lines.py shows the loggers' lines: no function takes a `say`."""
    takes_say = []
    for package in ("tupe_ds", "data_prep", "tests", "bench"):  # a call handing one too
        for folder, _, names in os.walk(os.path.join(ROOT, package)):
            for name in (n for n in names if n.endswith(".py")):
                path = os.path.join(folder, name)
                for node in ast.walk(ast.parse(open(path).read())):
                    if isinstance(node, (ast.FunctionDef, ast.Lambda)) and "say" in [
                            a.arg for a in [*node.args.args, *node.args.kwonlyargs]] or \
                            isinstance(node, ast.Call) and "say" in [k.arg for k in node.keywords]:
                        takes_say.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    assert not takes_say, "log through a module logger instead: " + ", ".join(takes_say)
