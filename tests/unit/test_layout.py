"""The package's layout, as docs/development.md describes it: wings, modules read in one sitting, no cycles.

Read from the source with ``ast`` (nothing is imported), so a move that
breaks the house fails here with the module's name, not at a user's import.
"""

import ast
import os
import re
import subprocess
import sys

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "ringtrain")

# A wing may import from its own level and below, never above. Cross-cutting
# modules at the top sit low (errors, backend) or in the middle (failure,
# watchdog, optim); the faces (cli, commands, horovod, the package __init__) sit on top.
LEVELS = {
    "errors": 0, "backend": 0, "environment": 0,
    "failure": 1, "watchdog": 1, "optim": 1, "io": 1, "cluster": 1, "data": 1,
    "comm": 2, "models": 2,
    "training": 3, "engine": 3, "torch": 3, "tensorflow": 3, "keras": 3,
    "commands": 4, "cli": 4, "__main__": 4, "__init__": 4, "horovod": 4,
}
MAX_TOP_MODULES = 10
# One module per idea, even a long one, rather than an idea cut into fragments to keep each class short:
# a module is read in one sitting up to about mpi4py's longest (720 lines).
MAX_MODULE_LINES = 750
MAX_FUNCTION_LINES = 80


def _modules():
    """name -> (path, parsed tree) for every module of the package ("comm.transports.ring", "__init__")."""
    found = {}
    for root, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                name = os.path.relpath(path, PACKAGE)[:-3].replace(os.sep, ".")
                with open(path, encoding="utf-8") as fh:
                    found[name] = (path, ast.parse(fh.read(), path))
    return found


MODULES = _modules()


def _package_of(name):
    """The package a module's relative imports start from ("" for the top)."""
    if name.endswith("__init__"):
        return name[: -len("__init__")].rstrip(".")
    return name.rpartition(".")[0]


def _resolve(name, node):
    """The absolute in-package module an ImportFrom names, or None for one outside the package."""
    if node.level == 0:
        if not (node.module or "").startswith("ringtrain"):
            return None
        return (node.module or "")[len("ringtrain"):].lstrip(".")
    parts = [p for p in _package_of(name).split(".") if p]
    parts = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
    return ".".join(parts + ([node.module] if node.module else []))


def _as_module(target):
    """``target`` as a key of MODULES (a package is its ``__init__``), or None."""
    for key in (target, f"{target}.__init__" if target else "__init__"):
        if key in MODULES:
            return key
    return None


def _imports(name, tree):
    """(imported module key, imported names, line) for every in-package import, lazy ones included."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _resolve(name, node)
            if target is None:
                continue
            names = []
            for alias in node.names:  # "from . import backend" imports a module, not a name of the package
                sub = _as_module(f"{target}.{alias.name}" if target else alias.name)
                if sub is not None:
                    out.append((sub, (), node.lineno))
                else:
                    names.append(alias.name)
            key = _as_module(target)
            if key is not None and names:
                out.append((key, tuple(names), node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("ringtrain."):
                    key = _as_module(alias.name[len("ringtrain."):])
                    if key is not None:
                        out.append((key, (), node.lineno))
    return out


def _wing(name):
    return name.split(".")[0]


def test_the_top_of_the_package_holds_few_modules():
    top = sorted(n for n in MODULES if "." not in n)
    assert len(top) <= MAX_TOP_MODULES, f"{len(top)} modules at the top of ringtrain/: {top}"


def test_every_wing_has_a_level():
    assert {_wing(n) for n in MODULES} <= set(LEVELS), "a new wing needs a level in LEVELS"


def test_no_module_is_too_long():
    long = [f"{name} ({tree.body[-1].end_lineno if tree.body else 0} lines)" for name, (_, tree) in MODULES.items()
            if tree.body and tree.body[-1].end_lineno > MAX_MODULE_LINES]
    assert not long, f"over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_is_too_long():
    long = [f"{name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for name, (_, tree) in MODULES.items() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"over {MAX_FUNCTION_LINES} lines: {long}"


def test_no_module_imports_another_modules_private_names():
    private = [f"{name}:{line} imports {names} from {target}"
               for name, (_, tree) in MODULES.items() for target, names, line in _imports(name, tree)
               if target != name and any(n.startswith("_") and not n.startswith("__") for n in names)]
    assert not private, private


def test_no_arrow_runs_up_from_a_lower_wing():
    upward = [f"{name}:{line} ({_wing(name)}, level {LEVELS[_wing(name)]}) imports {target} "
              f"({_wing(target)}, level {LEVELS[_wing(target)]})"
              for name, (_, tree) in MODULES.items() for target, _, line in _imports(name, tree)
              if LEVELS[_wing(target)] > LEVELS[_wing(name)]]
    assert not upward, upward


def test_the_import_graph_has_no_cycle():
    graph = {name: sorted({t for t, _, _ in _imports(name, tree) if t != name}) for name, (_, tree) in MODULES.items()}
    # A package's __init__ importing its own modules is how a face is made, not a cycle.
    graph = {n: [t for t in ts if not (t.endswith("__init__") and n.startswith(_package_of(t)))]
             for n, ts in graph.items()}
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            assert cycle is None, " -> ".join(cycle)


def test_the_cluster_face_imports_nothing():
    _, tree = MODULES["cluster.__init__"]
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


@pytest.mark.parametrize("library, home", [("torch", "torch"), ("cupy", "backend"), ("jax", "keras")])
def test_optional_libraries_are_imported_in_one_wing(library, home):
    outside = [f"{name}:{node.lineno}" for name, (_, tree) in MODULES.items() if _wing(name) != home
               for node in ast.walk(tree)
               if isinstance(node, ast.Import) and any(a.name.split(".")[0] == library for a in node.names)
               or isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == library]
    assert not outside, f"{library} imported outside ringtrain/{home}: {outside}"


def test_the_engine_imports_neither_torch_nor_tensorflow():
    # Imported for real, in a fresh interpreter: a framework pulled in through any module (ours or a
    # library's) would show in sys.modules, which the ast walk above cannot see.
    engine = sorted(f"ringtrain.{name}".removesuffix(".__init__") for name in MODULES if _wing(name) == "engine")
    code = ("import importlib, sys\n"
            f"for name in {engine!r}:\n"
            "    importlib.import_module(name)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'tensorflow', 'keras', 'jax')))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(PACKAGE))
    assert done.returncode == 0, done.stderr
    assert len(engine) >= 8 and done.stdout.strip() == "[]", done.stdout


def _test_map():
    """``{module path: [test paths]}`` from docs/development.md's table of where each module's tests are."""
    path = os.path.join(os.path.dirname(PACKAGE), "docs", "development.md")
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    section = text.split("## Where each module's tests are", 1)[1].split("\n## ", 1)[0]
    found = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`"):
            for module in re.findall(r"`([^`]+\.py)`", cells[0]):
                found[module] = re.findall(r"`([^`]+\.py)`", cells[1])
    return found


def test_the_development_page_says_where_every_modules_tests_are_and_each_file_it_names_exists():
    table = _test_map()
    modules = {os.path.relpath(p, PACKAGE) for p, _ in MODULES.values()}
    assert sorted(modules - set(table)) == [], "modules missing from docs/development.md's table of tests"
    assert sorted(set(table) - modules) == [], "modules in docs/development.md's table that do not exist"
    tests = os.path.join(os.path.dirname(PACKAGE), "tests")
    missing = sorted({t for ts in table.values() for t in ts if not os.path.isfile(os.path.join(tests, t))})
    assert not missing, f"test files named in docs/development.md that do not exist: {missing}"
    assert all(table.values()), [m for m, ts in table.items() if not ts]


def test_the_torch_face_and_the_engine_have_one_prefix_each_for_their_test_files():
    tests = os.path.join(os.path.dirname(PACKAGE), "tests")
    names = [f for d in ("unit", "mpi", "cli") for f in os.listdir(os.path.join(tests, d))]
    assert not [f for f in names if f.startswith("test_hvd_")], "the torch face's test files start test_torch_"
