"""The package layout (docs/development.md, "Layout"): tupe_ds's folders import downwards only, in
the order of LAYERS, and its modules import one another without cycles; the top level holds
folders and the main command only."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "tupe_ds")
LAYERS = ["tools", "distributed", "data", "model", "machine", "train", "export", "finetune",
          "compare", "demo", "pretrain"]  # bottom first: each may import the ones before it


def module_files() -> dict:
    """{dotted module name: path} of every module of tupe_ds."""
    found = {}
    for folder, _, names in os.walk(PACKAGE):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path[:-3], ROOT).replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def imports_of(path: str, modules: dict) -> set:
    """The tupe_ds modules `path` imports, at any depth (a function's imports count too)."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            submodules = [f"{node.module}.{alias.name}" for alias in node.names]
            # `from package import module` needs the module; the package only for other names
            names = submodules + [node.module] * any(m not in modules for m in submodules)
        else:
            continue
        found |= {name for name in names if name in modules and name != "tupe_ds"}
    return found


def layer(module: str) -> str:
    return module.split(".")[1]


def import_graph() -> dict:
    modules = module_files()
    return {module: imports_of(path, modules) for module, path in modules.items()}


def upward_imports(graph: dict) -> list:
    return [f"{module} imports {target}" for module, targets in graph.items()
            if module != "tupe_ds" for target in targets
            if LAYERS.index(layer(target)) > LAYERS.index(layer(module))]


def test_folders_import_downwards_only():
    assert upward_imports(import_graph()) == []


def find_cycle(graph: dict):
    """One import cycle of `graph` as a list of modules, or None."""
    state, stack = {}, []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[module] = "done"
        stack.pop()
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_modules_import_without_cycles():
    assert find_cycle(import_graph()) is None


def test_the_checks_find_what_they_look_for():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    assert upward_imports({"tupe_ds.model.bert": {"tupe_ds.train.loop", "tupe_ds.data.masking"}}) \
        == ["tupe_ds.model.bert imports tupe_ds.train.loop"]
    graph = import_graph()
    assert "tupe_ds.model.config" in graph["tupe_ds.train.config"]  # imports are seen
    assert "tupe_ds.export.read" in graph["tupe_ds.compare.report"]  # imported in a function


@pytest.mark.parametrize("name", sorted(set(os.listdir(PACKAGE)) - {"__init__.py", "__pycache__"}))
def test_the_top_level_holds_folders_of_a_layer_and_the_main_command(name):
    assert name.removesuffix(".py") in LAYERS, f"tupe_ds/{name}: put it in a folder of its kind"
