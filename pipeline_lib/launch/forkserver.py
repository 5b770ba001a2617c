"""Worker processes forked from a process that has already imported TensorFlow: a launch starts in a fraction of a second.

Importing TensorFlow and tfdag's worker takes seconds of CPU per process; a local launch of N workers paid it N
times per attempt, and a tuning study once per worker of every trial. A `ForkServer` is one long-lived process per
launcher process (`python -m pipeline_lib.launch.forkserver`) that imports the worker module once, prepares what a
first training would redo in every child (`training.prefork`: AutoGraph's conversions, lazy imports), puts what it
holds out of the garbage collector's reach (`gc.freeze`), then forks one child per task on request. A child is
what `python -m pipeline_lib.launch.worker --spec ...` would be:

- its own session (its pid is its process group: the launcher's group kill reaches what it starts too);
- the launch's environment (TF_CONFIG, secrets, test faults), working directory and `sys.path`;
- stdin from /dev/null, stdout and stderr into a pipe the launcher reads (`ForkedProcess.stdout`);
- its exit status reported like Popen's (`-9` for SIGKILL), told by the server over a socket per child;
- the command line `python -m pipeline_lib.launch.worker --spec ...` in `ps` (setproctitle);
- killed by Linux when the server dies (PDEATHSIG, `TFDAG_PARENT_PID` is the server), and the server when the
  launcher's process dies (PDEATHSIG, and its control socket's end of file).

What is fixed at import time (TF_*/CUDA_*/OMP_* variables, PYTHONPATH, the interpreter, TFDAG_VERBOSE) is the
server's key: a launch with other values gets (and keeps) its own server. Only the local launcher forks;
`TFDAG_FORK_SERVER=0` makes it start each worker with a plain `python -m` instead. Ray's tasks always do.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

try:
    import setproctitle
except ImportError:  # pragma: no cover - a declared dependency; without it `ps` shows the server's command line
    setproctitle = None

ENABLE_ENV = "TFDAG_FORK_SERVER"
# The variables read while TensorFlow, its libraries or Python start: a server imported under other values cannot
# serve this launch. Everything else (TF_CONFIG above all) is set per child.
_IMPORT_TIME_PREFIXES = ("TF_", "CUDA", "NVIDIA", "OMP_", "KMP_", "MKL", "OPENBLAS", "XLA_", "LD_", "MALLOC",
                         "PYTHON", "TFDAG_VERBOSE")
_PER_CHILD = ("TF_CONFIG",)
_READY_TIMEOUT_S = 180.0
_MESSAGE_MAX = 1 << 20
_START_CWD = os.getcwd()  # the server's: `python -m` put it first on sys.path, where a child wants its own


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    return (environ if environ is not None else os.environ).get(ENABLE_ENV, "1") != "0"


def server_key(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """What a server fixed when it imported TensorFlow: the import-time variables of `env` and the interpreter."""
    fixed = sorted((k, v) for k, v in env.items() if k.startswith(_IMPORT_TIME_PREFIXES) and k not in _PER_CHILD)
    return (("", sys.executable), *fixed)


class ForkedProcess:
    """A child of the fork server, with the part of `subprocess.Popen` the launcher uses: pid, stdout, poll, wait."""

    def __init__(self, pid: int, stdout, status: socket.socket):
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._status = status
        self._buffer = b""
        self._lock = threading.Lock()

    def _read_status(self, timeout_s: float | None) -> None:
        with self._lock:
            if self.returncode is not None:
                return
            ready, _, _ = select.select([self._status], [], [], timeout_s)
            if not ready:
                return
            chunk = self._status.recv(64)
            self._buffer += chunk
            if b"\n" in self._buffer:
                self.returncode = int(self._buffer.split(b"\n", 1)[0])
            elif not chunk:
                # The server died without telling: Linux killed the child with it (PDEATHSIG).
                self.returncode = -signal.SIGKILL
            if self.returncode is not None:
                self._status.close()

    def poll(self) -> int | None:
        self._read_status(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"forked pid {self.pid}", timeout)
            self._read_status(left)
        return self.returncode


class ForkServer:
    """The launcher's side of one server: `spawn()` forks a child that runs `module.main()` with `args`."""

    def __init__(self, env: Mapping[str, str], cwd: str):
        self._lock = threading.Lock()
        self._control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        started = threading.Event()
        failure: list[BaseException] = []

        def keep() -> None:
            # Linux's parent-death signal fires when the *thread* that forked the server exits: this thread lives as
            # long as the launcher's process, whichever short-lived thread (a Prefect task's) asked first.
            try:
                self._popen = subprocess.Popen(
                    [sys.executable, "-m", __name__, str(theirs.fileno()), str(os.getpid())],
                    env=dict(env), cwd=cwd, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL, start_new_session=True)
            except BaseException as error:  # noqa: BLE001 - told to the caller below
                failure.append(error)
                started.set()
                return
            started.set()
            self._popen.wait()

        threading.Thread(target=keep, name="tfdag-fork-server", daemon=True).start()
        started.wait()
        theirs.close()
        if failure:
            raise failure[0]
        self.pid = self._popen.pid
        ready, _, _ = select.select([self._control], [], [], _READY_TIMEOUT_S)
        message = self._control.recv(_MESSAGE_MAX) if ready else b""
        if message != b"ready":
            self.close()
            raise RuntimeError(f"the fork server (pid {self.pid}) did not start: "
                               f"{message.decode(errors='replace') or 'no answer'}")

    def alive(self) -> bool:
        return self._popen.poll() is None

    def spawn(self, module: str, args: Sequence[str], env: Mapping[str, str], cwd: str) -> ForkedProcess:
        read_end, write_end = os.pipe()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        request = json.dumps({"module": module, "args": list(args), "env": dict(env), "cwd": cwd}).encode()
        try:
            with self._lock:
                socket.send_fds(self._control, [request], [write_end, theirs.fileno()])
        except OSError:
            os.close(read_end)
            ours.close()
            raise
        finally:
            os.close(write_end)
            theirs.close()
        ready, _, _ = select.select([ours], [], [], 30.0)
        line = ours.recv(64) if ready else b""
        if not line.startswith(b"pid "):
            os.close(read_end)
            ours.close()
            raise RuntimeError(f"the fork server (pid {self.pid}) did not fork {module}: {line!r}")
        pid_text, _, rest = line[4:].partition(b"\n")
        child = ForkedProcess(int(pid_text), os.fdopen(read_end, "rb"), ours)
        child._buffer = rest
        return child

    def close(self) -> None:
        self._control.close()
        with contextlib.suppress(ProcessLookupError):
            self._popen.kill()


_servers: dict[tuple, ForkServer] = {}
_servers_lock = threading.Lock()


def server_for(env: Mapping[str, str]) -> ForkServer:
    """This process's server for `env`'s import-time values, started (a few seconds) on first use."""
    key = server_key(env)
    with _servers_lock:
        server = _servers.get(key)
        if server is None or not server.alive():
            server = _servers[key] = ForkServer({k: v for k, v in env.items() if k not in _PER_CHILD}, os.getcwd())
        return server


# ---- the server process ----------------------------------------------------------------------------------------

def _die_with(parent_pid: int) -> None:
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        os._exit(1)


def _child(request: dict, out_fd: int, keep_closed: Sequence[int], server_pid: int) -> None:
    """In the forked child: become the task's process, run its module's main(), never return."""
    code = 1
    try:
        _die_with(server_pid)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in keep_closed:
            with contextlib.suppress(OSError):
                os.close(fd)
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(out_fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if sys.path and sys.path[0] == _START_CWD:  # `python -m` put the server's working directory first
            sys.path[0] = request["cwd"]
        module = request["module"]
        sys.argv = [module, *request["args"]]
        if setproctitle is not None:
            setproctitle.setproctitle(" ".join([sys.executable, "-m", *sys.argv]))
        result = importlib.import_module(module).main()
        code = result if isinstance(result, int) else 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:  # noqa: BLE001 - the child's traceback goes to its output, like a Python process's
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve(control_fd: int, parent_pid: int) -> None:
    """The server's loop: fork a child per request, tell each child's exit status to its socket, end with the
    launcher (its control socket's end of file)."""
    _die_with(parent_pid)
    if setproctitle is not None:
        # Its first call moves the environment to make room for titles: here, while the environment is the one the
        # process started with (a child's title is set after its environment changed).
        setproctitle.setproctitle(f"{sys.executable} -m pipeline_lib.launch.forkserver (tfdag's fork server of pid "
                                  f"{parent_pid})")
    control = socket.socket(fileno=control_fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        from pipeline_lib.core.quiet import import_tensorflow

        import_tensorflow()
        importlib.import_module("pipeline_lib.launch.worker")
        # The training loop's AutoGraph conversions and lazy imports, once here instead of in every child.
        importlib.import_module("pipeline_lib.training.prefork").prepare()
    except BaseException as error:  # noqa: BLE001 - told to the launcher, which raises it
        control.send(f"import failed: {error!r}".encode()[:_MESSAGE_MAX])
        return
    # Out of the collector's reach: a child's first full collection would walk these hundreds of thousands of
    # objects and write to every page it read, copying the pages it shares with this process.
    gc.freeze()
    control.send(b"ready")
    children: dict[int, socket.socket] = {}
    while True:
        ready, _, _ = select.select([control, wake_r], [], [])
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 512)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            told = children.pop(pid, None)
            if told is not None:
                with contextlib.suppress(OSError):
                    told.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                told.close()
        if control in ready:
            message, fds, _, _ = socket.recv_fds(control, _MESSAGE_MAX, 2)
            if not message:
                return  # the launcher's process is gone: exiting kills every child (their PDEATHSIG)
            out_fd, status_fd = fds
            status = socket.socket(fileno=status_fd)
            request = json.loads(message)
            sys.stdout.flush()
            sys.stderr.flush()
            server_pid = os.getpid()
            pid = os.fork()
            if pid == 0:
                _child(request, out_fd,
                       [control.fileno(), wake_r, wake_w, status.fileno(), *(s.fileno() for s in children.values())],
                       server_pid)
            os.close(out_fd)
            children[pid] = status
            with contextlib.suppress(OSError):
                status.sendall(f"pid {pid}\n".encode())


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
