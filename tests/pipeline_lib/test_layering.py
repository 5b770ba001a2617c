"""The library layer stays free of Prefect: every stage runs from a notebook or a worker process."""

import ast
import subprocess
import sys
from pathlib import Path

LIB = Path(__file__).resolve().parents[2] / "pipeline_lib"


def test_no_module_of_pipeline_lib_imports_prefect():
    offenders = []
    for path in sorted(LIB.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in ("prefect", "tasks", "flows")]
    assert offenders == [], f"pipeline_lib must not import Prefect or the upper layers: {offenders}"


def test_importing_every_library_module_loads_no_prefect():
    modules = sorted(p.stem for p in LIB.glob("*.py") if p.stem != "__init__")
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module('pipeline_lib.' + m)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'prefect'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=LIB.parent, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "[]"
