"""MLflow stays behind the tracking interface: only `pipeline_lib/tracking/` (its backend) and `pipeline_lib/serving/`
(the logged pyfunc's loaders) import it; the rest of tfdag uses `tracking.tracker`."""

from __future__ import annotations

import ast
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[2]
SCANNED = ("pipeline_lib", "tasks", "flows", "deployments")
ALLOWED = ("pipeline_lib/tracking/", "pipeline_lib/serving/")


def mlflow_imports(project: Path) -> list[str]:
    """`path:line` of every import of mlflow (at any depth of a module) outside ALLOWED."""
    found = []
    for package in (p for p in SCANNED if (project / p).is_dir()):
        for path in sorted((project / package).rglob("*.py")):
            relative = path.relative_to(project).as_posix()
            if relative.startswith(ALLOWED):
                continue
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
                if any(name == "mlflow" or name.startswith("mlflow.") for name in names):
                    found.append(f"{relative}:{node.lineno}")
    return found


def test_only_tracking_and_serving_import_mlflow():
    found = mlflow_imports(PROJECT)
    assert found == [], f"MLflow imported outside {ALLOWED}: {found}; go through pipeline_lib.tracking.tracker"


def test_the_check_finds_an_import_inside_a_function(tmp_path):
    (tmp_path / "pipeline_lib" / "prediction").mkdir(parents=True)
    (tmp_path / "pipeline_lib" / "tracking").mkdir()
    (tmp_path / "pipeline_lib" / "prediction" / "models.py").write_text("def f():\n    from mlflow.models import Model\n")
    (tmp_path / "pipeline_lib" / "tracking" / "backend.py").write_text("import mlflow\n")
    assert mlflow_imports(tmp_path) == ["pipeline_lib/prediction/models.py:2"]
