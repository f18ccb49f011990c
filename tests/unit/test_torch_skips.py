"""Every test that runs a torch program skips where torch is not installed, found by reading the source.

The README's test command installs the ``[test]`` extra alone, without
torch; CI also runs the suite with torch, so a test that needs torch without
saying so would only fail for a user. Read with ``ast`` (nothing is run or
imported): a program under tests/cli/programs/ that imports torch (or
ringtrain.torch, or Horovod's API) is found here, then every test function,
in any test module, that names it (directly, through a module-level constant,
one imported from another test module, a helper function or a fixture) must
skip without torch: ``pytest.importorskip("torch")`` at module level or in
its body, or a ``skipif`` whose condition names torch on the function or as
the module's ``pytestmark``. tests/mpi files are checked the same way, with
their use of the imported ``torch`` as what must be guarded, unless
tests/test_mpi_suite.py skips the whole file (``TORCH_ONLY``).
"""

import ast
import glob
import os

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAMS = os.path.join(TESTS, "cli", "programs")
# Importing any of these imports torch.
TORCH_MODULES = ("torch", "ringtrain.torch", "ringtrain.interop", "horovod.torch", "torchvision")


def _parse(path):
    with open(path, encoding="utf-8") as fh:
        return ast.parse(fh.read(), path)


def _imported(node):
    """The module names an Import or ImportFrom brings in ("ringtrain.torch" for ``from ringtrain import torch``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def _is_torch(name):
    return any(name == m or name.startswith(m + ".") for m in TORCH_MODULES)


def _guarded(tree):
    """The import nodes inside a ``try`` whose handlers catch ImportError (optional imports)."""
    guarded = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any("ImportError" in ast.dump(h) or h.type is None for h in node.handlers):
            for inner in node.body:
                guarded.update(id(n) for n in ast.walk(inner))
    return guarded


def _module_level(tree):
    """The nodes of ``tree`` outside its functions' bodies (what runs at import)."""
    stack, found = list(tree.body), []
    while stack:
        node = stack.pop()
        found.append(node)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            stack.extend(ast.iter_child_nodes(node))
    return found


def torch_imports(tree, optional=False, at_import=False):
    """The import nodes of ``tree`` that import torch.

    Args:
        tree: a parsed module.
        optional: count those under ``try/except ImportError`` too.
        at_import: only those outside functions (run when the module is imported).
    """
    guarded = set() if optional else _guarded(tree)
    nodes = _module_level(tree) if at_import else ast.walk(tree)
    return [node for node in nodes if isinstance(node, (ast.Import, ast.ImportFrom))
            and id(node) not in guarded and any(_is_torch(name) for name in _imported(node))]


def torch_programs():
    """File names of the programs under tests/cli/programs/ that import torch unguarded."""
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(PROGRAMS, "*.py"))
                  if torch_imports(_parse(p)))


def _references(node):
    """The names and the string constants used anywhere in ``node`` (decorators and defaults included)."""
    names, strings = set(), set()
    for inner in ast.walk(node):
        if isinstance(inner, ast.Name):
            names.add(inner.id)
        elif isinstance(inner, ast.Constant) and isinstance(inner.value, str):
            strings.add(inner.value)
    return names, strings


def _mentions_torch(node):
    names, strings = _references(node)
    return "torch" in names or any(_is_torch(s) for s in strings)


def _is_importorskip_torch(node):
    return (isinstance(node, ast.Expr) or isinstance(node, ast.Assign)) and isinstance(node.value, ast.Call) \
        and getattr(node.value.func, "attr", None) == "importorskip" and node.value.args \
        and isinstance(node.value.args[0], ast.Constant) and _is_torch(node.value.args[0].value)


def _is_torch_skipif(node, markers):
    """A decorator or pytestmark value that skips without torch (or a module-level name bound to one)."""
    if isinstance(node, ast.Name):
        return node.id in markers
    return isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "skipif" and _mentions_torch(node)


class Module:
    """One test module: its functions, its module-level names and how it skips without torch."""

    def __init__(self, path):
        self.path = path
        self.tree = _parse(path)
        self.functions = {n.name: n for n in self.tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for cls in (n for n in self.tree.body if isinstance(n, ast.ClassDef)):
            self.functions.update({f"{cls.name}.{n.name}": n for n in cls.body if isinstance(n, ast.FunctionDef)})
        self.constants = {}  # module-level name -> its value's node
        for node in self.tree.body:
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        self.constants[target.id] = node.value
        self.markers = {name for name, value in self.constants.items() if _is_torch_skipif(value, set())}
        self.skips_whole = any(_is_importorskip_torch(n) for n in self.tree.body) or any(
            _is_torch_skipif(m, self.markers) for m in self._pytestmark())

    def _pytestmark(self):
        value = self.constants.get("pytestmark")
        if value is None:
            return []
        return value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value]

    def imports_from(self):
        """``{local name: (module, name)}`` for ``from module import name`` at module level."""
        return {alias.asname or alias.name: (node.module, alias.name) for node in self.tree.body
                if isinstance(node, ast.ImportFrom) and node.level == 0 for alias in node.names}

    def tainted_constants(self, is_tainted, imported_tainted):
        """Module-level names whose value uses something tainted (a program's file name, torch), to a fixed point."""
        tainted = set(imported_tainted)
        while True:
            more = {name for name, value in self.constants.items() if name not in tainted
                    and is_tainted(*_references(value), tainted)}
            if not more:
                return tainted
            tainted |= more

    def runners(self, is_tainted, tainted_names):
        """Names of the functions that use something tainted, directly or through another function of the module."""
        found = set()
        while True:
            more = set()
            for name, node in self.functions.items():
                if name in found:
                    continue
                names, strings = _references(node)
                args = {a.arg for a in node.args.args}
                calls = {n for n in names | args if n in found}
                if calls or is_tainted(names, strings, tainted_names):
                    more.add(name)
            if not more:
                return found
            found |= more

    def skips(self, name):
        """Whether test ``name`` skips without torch."""
        if self.skips_whole:
            return True
        node = self.functions[name]
        if any(_is_torch_skipif(d, self.markers) for d in node.decorator_list):
            return True
        return any(_is_importorskip_torch(statement) for statement in node.body)


def _uses_program(programs):
    def is_tainted(names, strings, tainted_names):
        return bool(names & tainted_names) or any(p in s for s in strings for p in programs)
    return is_tainted


def _uses_torch(names, strings, tainted_names):
    return bool(names & tainted_names) or "torch" in names


def unguarded_tests(modules, is_tainted):
    """``module path::test`` for each test that uses something tainted and does not skip without torch."""
    tainted = {}
    for _ in range(len(modules) + 1):  # constants imported from one test module into another, to a fixed point
        by_name = {os.path.basename(path)[:-3]: names for path, names in tainted.items()}
        for path, module in modules.items():
            imported = {local for local, (source, name) in module.imports_from().items()
                        if name in by_name.get(source, ())}
            tainted[path] = module.tainted_constants(is_tainted, imported)
    bad = []
    for path, module in modules.items():
        for name in sorted(module.runners(is_tainted, tainted[path])):
            if name.rpartition(".")[2].startswith("test_") and not module.skips(name):
                bad.append(f"{os.path.relpath(path, TESTS)}::{name}")
    return bad


def _test_modules(*folders):
    paths = []
    for folder in folders:
        paths += glob.glob(os.path.join(TESTS, folder, "test_*.py"))
    paths = [p for p in paths if os.path.abspath(p) != os.path.abspath(__file__)]  # it names programs as data
    return {p: Module(p) for p in sorted(paths)}


def test_the_programs_that_import_torch_are_found():
    # The check below is only as good as this list: it must hold the known ones.
    found = torch_programs()
    assert {"elastic_train.py", "torch_train.py", "horovod_script.py", "hvd_failures.py"} <= set(found), found
    assert "faulty_train.py" not in found and "raise_on_rank.py" not in found, found


def test_every_test_that_runs_a_torch_program_skips_without_torch():
    modules = _test_modules(".", "cli", "unit")
    assert unguarded_tests(modules, _uses_program(torch_programs())) == [], (
        "these tests run a program that imports torch but do not skip where torch is not installed "
        "(the README's `pip install -e '.[test]'`): add @pytest.mark.skipif(importlib.util.find_spec(\"torch\") "
        "is None, reason=...) or pytest.importorskip(\"torch\")")


def test_every_mpi_test_that_uses_torch_skips_without_torch():
    from test_mpi_suite import TORCH_ONLY

    modules = {path: module for path, module in _test_modules("mpi").items()
               if os.path.relpath(path, os.path.dirname(TESTS)) not in TORCH_ONLY}
    unguarded = [os.path.relpath(p, TESTS) for p, m in modules.items() if torch_imports(m.tree, at_import=True)
                 and not m.skips_whole]
    assert unguarded == [], "these tests/mpi files import torch unguarded: add them to TORCH_ONLY in test_mpi_suite.py"
    with_torch = {p: m for p, m in modules.items() if torch_imports(m.tree, optional=True)}
    assert unguarded_tests(with_torch, _uses_torch) == [], "these tests/mpi tests use torch without a skip"


def test_the_check_catches_a_test_that_runs_a_torch_program_without_a_skip(tmp_path):
    # A module shaped like the one that slipped through: the program's path imported from another test module.
    (tmp_path / "test_a.py").write_text('import pytest\nPROGRAM = "x/elastic_train.py"\n\n'
                                        '@pytest.mark.skipif(find_spec("torch") is None, reason="")\n'
                                        'def test_skips():\n    run(PROGRAM)\n')
    (tmp_path / "test_b.py").write_text("from test_a import PROGRAM\n\ndef _go():\n    run([PROGRAM])\n\n"
                                        "def test_runs(tmp_path):\n    _go()\n\n"
                                        'def test_skips_in_body():\n    pytest.importorskip("torch")\n    _go()\n')
    modules = {str(p): Module(str(p)) for p in sorted(tmp_path.glob("test_*.py"))}
    bad = unguarded_tests(modules, _uses_program(["elastic_train.py"]))
    assert [b.rpartition("::")[2] for b in bad] == ["test_runs"], bad


def test_the_check_catches_an_mpi_test_that_uses_an_optional_torch_without_a_skip(tmp_path):
    (tmp_path / "test_m.py").write_text(
        "import pytest\ntry:\n    import torch\nexcept ImportError:\n    torch = None\n"
        'needs = pytest.mark.skipif(torch is None, reason="")\n\n'
        "def _model():\n    return torch.nn.Linear(2, 2)\n\n"
        "@needs\ndef test_skips():\n    _model()\n\n"
        "def test_uses_torch():\n    _model()\n\n"
        "def test_plain():\n    assert 1\n")
    module = Module(str(tmp_path / "test_m.py"))
    assert not torch_imports(module.tree, at_import=True) and torch_imports(module.tree, optional=True)
    assert [b.rpartition("::")[2] for b in unguarded_tests({str(tmp_path / "test_m.py"): module}, _uses_torch)] == \
        ["test_uses_torch"]
