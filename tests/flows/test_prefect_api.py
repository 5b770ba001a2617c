"""flows.prefect_api: PREFECT_API_URL, then a running stack, else an ephemeral server on a database under .tfdag/."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flows.prefect_api import choose_prefect_api

_TRIVIAL_FLOW = """
import sys
from flows.prefect_api import api_from_profile, choose_prefect_api
chosen = choose_prefect_api(sys.argv[1])
from prefect import flow

@flow
def answer() -> int:
    return 42

assert answer() == 42
print(api_from_profile(chosen).describe())
"""


def test_prefect_api_url_wins(tmp_path):
    environ = {"PREFECT_API_URL": "http://127.0.0.1:1/api"}
    chosen = choose_prefect_api(tmp_path / ".tfdag", environ)
    assert (chosen.source, chosen.url) == ("PREFECT_API_URL", "http://127.0.0.1:1/api")
    assert "PREFECT_SERVER_DATABASE_CONNECTION_URL" not in environ


def test_without_a_server_the_database_goes_under_the_root_unless_one_is_set(tmp_path):
    environ: dict[str, str] = {}
    chosen = choose_prefect_api(tmp_path / ".tfdag", environ)
    database = (tmp_path / ".tfdag" / "prefect" / "prefect.db").resolve()
    assert (chosen.source, chosen.url, chosen.database_path) == ("ephemeral", None, database)
    assert environ["PREFECT_SERVER_DATABASE_CONNECTION_URL"] == f"sqlite+aiosqlite:///{database}"
    own = {"PREFECT_API_DATABASE_CONNECTION_URL": "postgresql+asyncpg://db/prefect"}
    choose_prefect_api(tmp_path / ".tfdag", own)
    assert own["PREFECT_API_DATABASE_CONNECTION_URL"] == "postgresql+asyncpg://db/prefect"
    assert "PREFECT_SERVER_DATABASE_CONNECTION_URL" not in own


@pytest.mark.slow
def test_ephemeral_server_keeps_its_database_in_the_project_not_in_home(tmp_path):
    """A flow with no API configured: Prefect's ephemeral server writes <root>/prefect/prefect.db, not ~/.prefect."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PREFECT_") or k == "PREFECT_SERVER_ANALYTICS_ENABLED"}
    env.update(HOME=str(home), PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                           env.get("PYTHONPATH", "")]))
    root = tmp_path / "project" / ".tfdag"
    done = subprocess.run([sys.executable, "-c", _TRIVIAL_FLOW, str(root)], env=env, capture_output=True,
                          text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "an ephemeral Prefect server" in done.stdout
    assert (root / "prefect" / "prefect.db").is_file()
    assert not (home / ".prefect" / "prefect.db").exists()


def test_a_running_stack_with_ray_gives_its_api_and_its_ray_address(tmp_path, tfdag_stack):
    # `tfdag stack up --ray N && tfdag run examples/digits_ray.yaml`: the run finds the stack's Prefect server and,
    # unless RAY_ADDRESS is set, its Ray cluster (the session's stack, recorded with a Ray cluster under a new root).
    from flows import stack
    from flows.stack.ray_cluster import RayClusterRecord

    root = tmp_path / ".tfdag"
    ray = RayClusterRecord(address="127.0.0.2:6390", dashboard_url="http://127.0.0.2:8265", temp_dir=str(tmp_path),
                           num_nodes=3)
    stack.write_state(root, tfdag_stack.state.model_copy(update={"root": str(root), "ray": ray}))
    environ: dict[str, str] = {}
    chosen = choose_prefect_api(root, environ)
    assert (chosen.source, chosen.url) == ("tfdag stack", tfdag_stack.state.prefect_api_url)
    assert environ == {"PREFECT_API_URL": tfdag_stack.state.prefect_api_url, "RAY_ADDRESS": "127.0.0.2:6390"}
    assert "Ray: the stack's cluster at 127.0.0.2:6390" in chosen.describe()
    mine = {"RAY_ADDRESS": "10.0.0.5:6379"}
    assert choose_prefect_api(root, mine).ray_address is None and mine["RAY_ADDRESS"] == "10.0.0.5:6379"


_HEARTBEATS = """
from flows.prefect_api import heartbeats_only_when_set
from prefect import flow
from prefect.settings import get_current_settings


@flow
def frequency():  # what the flow run engine reads to start (or not) its heartbeat thread
    return get_current_settings().flows.heartbeat_frequency


with heartbeats_only_when_set():
    print(frequency())
print(get_current_settings().flows.heartbeat_frequency)
"""


@pytest.mark.parametrize("set_to", [None, "60"])
def test_a_flow_tfdag_runs_sends_prefect_heartbeats_only_when_their_frequency_is_set(prefect_api, set_to):
    env = {k: v for k, v in os.environ.items() if not k.endswith("_HEARTBEAT_FREQUENCY")}
    env.update(PREFECT_API_URL=prefect_api, **({"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": set_to} if set_to else {}))
    done = subprocess.run([sys.executable, "-c", _HEARTBEATS], env=env, capture_output=True, text=True, timeout=300,
                          check=True)
    inside, after = done.stdout.split()[-2:]
    if set_to is None:
        assert inside == "None" and after != "None"  # off for the flow only; Prefect's default around it
    else:
        assert inside == after == set_to
