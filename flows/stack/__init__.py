"""The local stack behind `tfdag stack up|down|status`: Prefect and MLflow servers, a work pool, a worker,
deployments and, when asked for, a Ray cluster.

`state` (the state file, ports), `processes` (start, find and stop exactly one process and its family),
`ray_cluster` (a local Ray cluster's nodes), `servers` (starting the Prefect and MLflow servers, the worker, the
deployments), `services` (each service described once), `profile` (the user's Prefect profile) and `commands`
(up, down, status and their report).
"""

from flows.stack.commands import (
    ServiceStatus,
    print_addresses,
    stack_command,
    stack_down,
    stack_status,
    stack_up,
)
from flows.stack.processes import (
    ServiceRecord,
    StackError,
    console_script,
    find_process,
    start_process,
    stop_process,
    wait_until,
)
from flows.stack.profile import PROFILE
from flows.stack.servers import (
    WORK_POOL,
    WORKER_NAME,
    prefect_server_answers,
    start_prefect_server,
)
from flows.stack.services import env_file_text
from flows.stack.state import (
    HOST,
    StackState,
    choose_port,
    env_port,
    read_state,
    stack_dir,
    state_path,
    write_state,
)

__all__ = [
    "HOST", "PROFILE", "WORKER_NAME", "WORK_POOL", "ServiceRecord", "ServiceStatus", "StackError", "StackState",
    "choose_port", "console_script", "env_file_text", "env_port", "find_process", "prefect_server_answers",
    "print_addresses", "read_state", "stack_command", "stack_dir", "stack_down", "stack_status", "stack_up",
    "start_prefect_server", "start_process", "state_path", "stop_process", "wait_until", "write_state",
]
