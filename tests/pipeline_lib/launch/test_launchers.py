"""Tests for pipeline_lib.launch.launchers: the registry is the only place naming launcher modules, each registered
launcher satisfies the `Launcher` protocol, and a config picks its launcher (and its input checks) through it."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline_lib.config import ConfigError, Launcher, TrainConfig
from pipeline_lib.launch import launchers
from pipeline_lib.launch.protocol import Launcher as LauncherProtocol
from tests.pipeline_lib.launch_support import REPO_ROOT, make_config

REGISTRY = "pipeline_lib.launch.launchers"
SOURCE_DIRS = ("pipeline_lib", "tasks", "flows", "bench", "deployments")


@pytest.mark.parametrize("name", sorted(launchers.LAUNCHERS))
def test_each_registered_launcher_satisfies_the_protocol(name):
    launcher = launchers.get_launcher(name)
    assert isinstance(launcher, LauncherProtocol)
    assert launcher.name == name
    options = inspect.signature(launcher.launch_training).parameters["options"]
    assert options.kind == inspect.Parameter.KEYWORD_ONLY and options.default == launchers.LaunchOptions()
    assert list(inspect.signature(launcher.check_inputs).parameters) == ["config", "environ"]
    assert list(inspect.signature(launcher.warm_up).parameters) == ["config"]
    if launcher.config_model is not None:  # its settings are the section train.<name>, of its own model
        assert TrainConfig.model_fields[name].annotation is launcher.config_model


def test_every_train_launcher_value_is_registered_and_nothing_else_but_in_process():
    assert set(launchers.LAUNCHERS) == {member.value for member in Launcher} | {launchers.IN_PROCESS}


def test_an_unregistered_name_names_the_registered_ones():
    with pytest.raises(LookupError, match=r"no launcher 'k8s' is registered .*\(registered: in_process, local, ray\)"):
        launchers.get_launcher("k8s")


def test_the_local_warm_up_starts_the_fork_server_its_launch_will_fork_from(tmp_path):
    from pipeline_lib.launch import forkserver
    from pipeline_lib.launch.processes import ONE_PROCESS, worker_env

    config = make_config(str(tmp_path))
    launchers.warm_up(config)
    env = worker_env(ONE_PROCESS, config.for_process()[1])
    deadline = time.monotonic() + 120
    while forkserver.server_key(env) not in forkserver._servers and time.monotonic() < deadline:
        time.sleep(0.2)
    assert forkserver.server_for(env).alive()


def test_a_config_picks_its_launcher(tmp_path):
    assert launchers.launcher_for(make_config(str(tmp_path))).name == "local"
    assert launchers.launcher_for(make_config(str(tmp_path), isolation="none")).name == "in_process"
    assert launchers.launcher_for(make_config(str(tmp_path), launcher="ray")).name == "ray"


def test_the_ray_launchers_input_check_runs_through_the_registry(tmp_path):
    ray = make_config(str(tmp_path), launcher="ray")
    with pytest.raises(ConfigError, match="neither train.ray.address nor the RAY_ADDRESS environment variable"):
        launchers.check_inputs(ray, environ={})
    launchers.check_inputs(ray, environ={"RAY_ADDRESS": "10.0.0.5:6379"})
    launchers.check_inputs(make_config(str(tmp_path)), environ={})  # local: no address needed


def _launcher_imports(path: Path, modules: set[str]) -> list[str]:
    """Every launcher module `path` imports, or names as a string (an importlib path)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name in modules]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found += [node.module] if node.module in modules else [
                f"{node.module}.{alias.name}" for alias in node.names if f"{node.module}.{alias.name}" in modules]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in modules:
            found.append(node.value)
    return found


def test_only_the_registry_and_the_launchers_themselves_name_a_launcher_module():
    modules = set(launchers.LAUNCHERS.values())
    # A launcher may build on another (in_process and ray_launcher reuse local's restart loop).
    allowed = {REGISTRY, *modules}
    root = Path(REPO_ROOT)
    offenders = {}
    for directory in SOURCE_DIRS:
        for path in sorted((root / directory).rglob("*.py")):
            module = ".".join(path.relative_to(root).with_suffix("").parts)
            named = _launcher_imports(path, modules)
            # Test support patches the local launcher's capacity (testing.local_nodes): it names what it fakes.
            if named and module not in allowed and not module.startswith("pipeline_lib.testing."):
                offenders[module] = named
    assert offenders == {}, f"go through {REGISTRY} (launch_training, launcher_for) instead: {offenders}"


def test_the_check_finds_a_launcher_imported_by_name(tmp_path):
    modules = set(launchers.LAUNCHERS.values())
    for text in ("from pipeline_lib.launch import local as launcher\n", "import pipeline_lib.launch.ray_launcher\n",
                 "from pipeline_lib.launch.in_process import launch_training\n"):
        (tmp_path / "caller.py").write_text(text)
        assert _launcher_imports(tmp_path / "caller.py", modules), text


def test_picking_the_local_launcher_imports_no_ray():
    code = ("import sys\nfrom pipeline_lib.launch import launchers\n"
            "launchers.get_launcher('local'), launchers.get_launcher('in_process')\n"
            "print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.stdout.strip().splitlines()[-1:] == ["False"], out.stderr
