"""The project's shape: the library has no Prefect, no import cycle and imports only down the stage order; tasks
import only the library (and Prefect), flows import tasks and the library, and no module grows past one concern."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parents[2]
LIB = PROJECT / "pipeline_lib"
# The layers above the library, lowest first: tasks wrap stage functions, flows compose tasks (and the CLI).
APP_LAYERS = ("tasks", "flows")
APP_FORBIDDEN_ROOTS = ("tests", "bench")  # test support and benchmarks import the product, never the reverse
MAX_MODULE_LINES = 450  # "about 400": one concern a module

# The order of the layers, lowest first: a module may import its own package and the layers below it.
# Packages on one layer may import each other as long as no circle forms (planning reads data's manifest).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("core", "config"),
    ("data", "planning", "cluster"),
    ("checkpoints",),
    ("training", "serving"),
    ("evaluation", "tracking", "tuning"),
    ("launch", "prediction"),
    ("reproduce",),
    ("testing",),
)
# Test support: production code reaches it only inside a function, when its environment variable is set.
TEST_SUPPORT = "testing"
FORBIDDEN_ROOTS = ("prefect", "tasks", "flows")


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, root: Path, modules: set[str]) -> list[tuple[str, bool, int]]:
    """(imported module, at module level?, line) for every import in `path`, resolved to a module of `modules`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
            # `from pkg import module` names the module; `from module import name` names the module itself.
            targets = [t for t in targets if t in modules] or [node.module]
        for target in targets:
            found.append((target, id(node) in top_level, node.lineno))
    return found


def _layer_of(package: str) -> int:
    for rank, names in enumerate(LAYERS):
        if package in names:
            return rank
    raise AssertionError(f"pipeline_lib.{package} is on no layer of LAYERS: add it to the order in this test")


def check_layering(root: Path) -> list[str]:
    """Every violation of the order, the cycles and the forbidden imports in the package at `root`."""
    files = {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    modules = set(files)
    lib = root.name
    problems: list[str] = []
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in files.items():
        own = module.split(".")[1] if module.count(".") else ""
        for target, at_top, line in _imports(path, root, modules):
            where = f"{path.relative_to(root.parent)}:{line}"
            if target.split(".")[0] in FORBIDDEN_ROOTS:
                problems.append(f"{where} imports {target}: {lib} never imports Prefect, tasks or flows")
                continue
            if not target.startswith(lib + ".") or target not in modules:
                continue
            other = target.split(".")[1]
            if other == TEST_SUPPORT and own != TEST_SUPPORT:
                if at_top:
                    problems.append(f"{where} imports {target} at module level: test support is imported only "
                                    f"inside the function that checks its environment variable")
                continue
            if own and other != own and _layer_of(other) > _layer_of(own):
                problems.append(f"{where}: {own} (layer {_layer_of(own)}) imports {target} "
                                f"(layer {_layer_of(other)}), against the order {LAYERS}")
            if target != module:
                graph[module].add(target)
    problems += [f"import cycle: {' -> '.join(cycle)}" for cycle in _cycles(graph)]
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        source = module.split(".")[1] if module.count(".") else ""
        for target in targets:
            if source and target.split(".")[1] != source:
                packages.setdefault(source, set()).add(target.split(".")[1])
    problems += [f"package cycle: {' -> '.join(cycle)}" for cycle in _cycles(packages)]
    return problems


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component that has one (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [component + [component[0]] for component in components]


def test_pipeline_lib_imports_only_down_the_order_without_cycles():
    problems = check_layering(LIB)
    assert problems == [], "\n".join(problems)


def _write_tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pipeline_lib"
    for name, text in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
        path.write_text(text)
    return root


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"core/a.py": "from pipeline_lib.training import loop\n", "training/loop.py": ""},
         "core (layer 0) imports pipeline_lib.training.loop"),
        ({"checkpoints/store.py": "from pipeline_lib.training.loop import Result\n",
          "training/loop.py": "from pipeline_lib.checkpoints import store\n"},
         "checkpoints (layer 2) imports pipeline_lib.training.loop"),
        ({"data/a.py": "def f():\n    from pipeline_lib.data import b\n", "data/b.py": "from pipeline_lib.data import a\n"},
         "import cycle: pipeline_lib.data.a -> pipeline_lib.data.b -> pipeline_lib.data.a"),
        ({"data/a.py": "from pipeline_lib.planning import p\n", "planning/p.py": "from pipeline_lib.data import b\n",
          "data/b.py": ""},
         "package cycle: data -> planning -> data"),
        ({"launch/worker.py": "from pipeline_lib.testing import faults\n", "testing/faults.py": ""},
         "imports pipeline_lib.testing.faults at module level"),
        ({"training/loop.py": "import prefect\n"}, "never imports Prefect"),
    ],
    ids=["upward", "upward-cycle", "local-import-cycle", "package-cycle", "test-support", "prefect"],
)
def test_the_layering_check_finds_each_kind_of_violation(tmp_path, files, expected):
    problems = check_layering(_write_tree(tmp_path, files))
    assert any(expected in p for p in problems), problems


def test_the_layering_check_allows_a_lazy_import_of_test_support_and_imports_down(tmp_path):
    files = {"launch/worker.py": "from pipeline_lib.training import loop\n"
                                 "def f():\n    from pipeline_lib.testing import faults\n",
             "training/loop.py": "from pipeline_lib.core import storage\nfrom pipeline_lib.config import C\n",
             "core/storage.py": "", "config.py": "", "testing/faults.py": "from pipeline_lib.launch import worker\n"}
    assert check_layering(_write_tree(tmp_path, files)) == []


def check_app_layering(project: Path) -> list[str]:
    """Every import of tasks/ and flows/ against APP_LAYERS (tasks never import flows), and their import cycles."""
    files = {_module_name(p, project / package): p
             for package in APP_LAYERS if (project / package).is_dir() for p in sorted((project / package).rglob("*.py"))}
    modules = set(files)
    problems: list[str] = []
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in files.items():
        own = module.split(".")[0]
        for target, _at_top, line in _imports(path, project / own, modules):
            other = target.split(".")[0]
            if other in APP_FORBIDDEN_ROOTS:
                problems.append(f"{path.relative_to(project)}:{line}: {own} imports {target}, which is not product code")
            if other in APP_LAYERS and APP_LAYERS.index(other) > APP_LAYERS.index(own):
                problems.append(f"{path.relative_to(project)}:{line}: {own} imports {target}; {own} imports only "
                                f"the layers below it ({', '.join(APP_LAYERS[:APP_LAYERS.index(own)]) or 'none'} "
                                "and pipeline_lib)")
            if target in modules and target != module:
                graph[module].add(target)
    return problems + [f"import cycle: {' -> '.join(cycle)}" for cycle in _cycles(graph)]


def test_tasks_and_flows_import_only_down_without_cycles():
    problems = check_app_layering(PROJECT)
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"tasks/stages.py": "from flows import pipeline\n", "flows/pipeline.py": ""},
         "tasks/stages.py:1: tasks imports flows.pipeline"),
        ({"flows/a.py": "from flows.b import x\n", "flows/b.py": "def f():\n    from flows import a\n"},
         "import cycle: flows.a -> flows.b -> flows.a"),
        ({"flows/cli.py": "import tests.servers\n"}, "flows/cli.py:1: flows imports tests.servers"),
    ],
    ids=["tasks-import-flows", "flows-cycle", "flows-import-tests"],
)
def test_the_app_layering_check_finds_each_kind_of_violation(tmp_path, files, expected):
    for name, text in {"tasks/__init__.py": "", "flows/__init__.py": "", **files}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert any(expected in p for p in check_app_layering(tmp_path)), check_app_layering(tmp_path)


@pytest.mark.parametrize("package", ["pipeline_lib", *APP_LAYERS])
def test_no_module_exceeds_the_size_of_one_concern(package):
    long = {str(p.relative_to(PROJECT)): n for p in (PROJECT / package).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}, f"split these modules by concern (at most ~400 lines each): {long}"


def test_importing_every_library_module_loads_no_prefect():
    modules = sorted(_module_name(p, LIB) for p in LIB.rglob("*.py"))
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('prefect', 'tasks', 'flows')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=LIB.parent, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_only_the_worker_entry_reaches_test_support_and_no_production_module_reads_a_test_variable():
    """Test faults enter through one seam: the worker entry, which alone imports pipeline_lib.testing (when a test
    variable is set) and alone names those variables; every other production module offers public hooks only."""
    entry = LIB / "launch" / "worker.py"
    names = {"TFDAG_FAULT", "TFDAG_EXPORT_FAULT", "TFDAG_PREFLIGHT_OVERRIDE"}
    modules = {_module_name(p, LIB) for p in LIB.rglob("*.py")}
    problems = []
    for path in sorted(LIB.rglob("*.py")):
        if path.relative_to(LIB).parts[0] == TEST_SUPPORT or path == entry:
            continue
        where = path.relative_to(PROJECT)
        problems += [f"{where}:{line} imports {target}" for target, _top, line in _imports(path, LIB, modules)
                     if target.startswith(f"pipeline_lib.{TEST_SUPPORT}")]
        problems += [f"{where}:{node.lineno} names {node.value}" for node in ast.walk(ast.parse(path.read_text()))
                     if isinstance(node, ast.Constant) and isinstance(node.value, str)
                     and (node.value in names or node.value.startswith("TFDAG_TEST_"))]
    assert problems == [], "\n".join(problems)
