"""Worker processes forked from a process that has already imported TensorFlow: a launch starts in a fraction of a second.

Importing TensorFlow and tfdag's worker takes about 5 s of CPU per process; a local launch of N workers paid it N
times per attempt, and a tuning study once per worker of every trial. A `ForkServer` is one long-lived process per
launcher process (`python -m pipeline_lib.launch.forkserver`) that imports the worker module once, then forks one
child per task on request. A child is what `python -m pipeline_lib.launch.worker --spec ...` would be:

- its own session (its pid is its process group: the launcher's group kill reaches what it starts too);
- the launch's environment (TF_CONFIG, secrets, test faults), working directory and `sys.path`;
- stdin from /dev/null, stdout and stderr into a pipe the launcher reads (`ForkedProcess.stdout`);
- its exit status reported like Popen's (`-9` for SIGKILL), told by the server over a socket per child;
- the command line `python -m pipeline_lib.launch.worker --spec ...` in `ps` (setproctitle);
- killed by Linux when the server dies (PDEATHSIG, `TFDAG_PARENT_PID` is the server), and the server when the
  launcher's process dies (PDEATHSIG, and its control socket's end of file).

A forked child still starts TensorFlow's runtime, its thread pools and its tracing cold (1.5–2 s of a short
training here), and the server cannot warm them before it forks: the runtime's threads do not survive a fork. So a
launch may ask for a warm child (`spawn(..., warm=True)`, a tuning trial's one-process worker): after the first such
launch the server keeps one *spare*, a child forked ahead that runs the module's `warm_up(args, background)` with the
args of the launch before it (the worker reads that trial's spec, then trains its config for a few steps) after its
fork, at idle priority from `background()` on (it uses only what the running launch leaves idle), with its output
to /dev/null, in its own session, dying with the server; then it waits on its socket. The next warm launch of that
module is handed to it (the request and its output pipe over SCM_RIGHTS) and the server forks the next spare in the
background; a launch while the spare still warms up is forked as above. The spare is forked from the
server, never from a task, so it holds no launch's environment, TF_CONFIG or port; a spare that dies before its task
(a failed warm-up) ends spares for that server.

What is fixed at import time (TF_*/CUDA_*/OMP_* variables, PYTHONPATH, the interpreter, TFDAG_VERBOSE) is the
server's key: a launch with other values gets (and keeps) its own server. Only the local launcher forks;
`TFDAG_FORK_SERVER=0` makes it start each worker with a plain `python -m` instead. Ray's tasks always do.
"""

from __future__ import annotations

import contextlib
import ctypes
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
from collections.abc import Callable, Mapping, Sequence

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
_SERVER_MODULE = "pipeline_lib.launch.forkserver"  # this module, also where it runs as __main__
_START_CWD = os.getcwd()  # the server's: `python -m` put it first on sys.path, where a child wants its own
# What a warm spare tells the server once its module's warm_up() returned.
_WARM = b"warm"


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

    def spawn(self, module: str, args: Sequence[str], env: Mapping[str, str], cwd: str, *,
              warm: bool = False) -> ForkedProcess:
        """A child running `module.main()` with `args`, `env` and `cwd`.

        With `warm`, the child may be the server's spare: a process forked ahead of this launch that already ran
        `module.warm_up(args, background)` with the args of the launch before (TensorFlow's runtime started). Only a
        task that needs no runtime configuration before its first op may be warm. The first warm launch of a server
        makes it keep one spare from then on.
        """
        read_end, write_end = os.pipe()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        request = json.dumps({"module": module, "args": list(args), "env": dict(env), "cwd": cwd,
                              "warm": warm}).encode()
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


def _detach(keep_closed: Sequence[int], server_pid: int) -> None:
    """In a forked child: die with the server, the default signal handling, none of the server's descriptors, and
    its own session (its pid is its process group: the launcher's group kill reaches what it starts)."""
    _die_with(server_pid)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for fd in keep_closed:
        with contextlib.suppress(OSError):
            os.close(fd)
    os.setsid()


def _child(request: dict, out_fd: int, keep_closed: Sequence[int], server_pid: int) -> None:
    """In the forked child: become the task's process, run its module's main(), never return."""
    code = 1
    try:
        _detach(keep_closed, server_pid)
        code = _run(request, out_fd)
    finally:
        os._exit(code)


def _spare(before: dict, channel: socket.socket, keep_closed: Sequence[int], server_pid: int) -> None:
    """In a spare child: warm the module of the launch `before` up (its `warm_up(args, background)` with that
    launch's args, at idle priority from its call of `background()` on, output to /dev/null), tell the server, then
    wait on `channel` for a task (its request and output descriptor) and become it at normal priority; never return.
    A failed warm-up ends the spare (exit 1): the server then forks each task itself."""
    code = 1
    try:
        _detach(keep_closed, server_pid)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.close(null)
        if setproctitle is not None:
            setproctitle.setproctitle(f"{sys.executable} -m {_SERVER_MODULE} (a warm spare of tfdag's fork server "
                                      f"{server_pid})")
        warm_up = getattr(importlib.import_module(before["module"]), "warm_up", None)
        if warm_up is not None:
            # It runs while the launch before runs, on idle CPU only once it read what it needs of that launch
            # (`background()`), so it does not slow that launch down.
            warm_up(before["args"], lambda: _set_policy(os.getpid(), os.SCHED_IDLE))
        channel.sendall(_WARM)
        message, fds, _, _ = socket.recv_fds(channel, _MESSAGE_MAX, 1)
        channel.close()
        if not message or len(fds) != 1:
            code = 0  # the server closed: it is going away
        else:
            # Every thread, the runtime's pools started by the warm-up included (a thread inherits its creator's).
            for tid in os.listdir("/proc/self/task"):
                _set_policy(int(tid), os.SCHED_OTHER)
            code = _run(json.loads(message), fds[0])
    finally:
        os._exit(code)


def _set_policy(tid: int, policy: int) -> None:
    """Thread `tid`'s scheduling policy (Linux lets an unprivileged thread go back from SCHED_IDLE to SCHED_OTHER at
    its nice value); a thread that ended meanwhile is skipped."""
    with contextlib.suppress(ProcessLookupError):
        os.sched_setscheduler(tid, policy, os.sched_param(0))


def _run(request: dict, out_fd: int) -> int:
    """Become the task's process (stdio, directory, environment, argv, title) and run its module's main(); return
    its exit code."""
    code = 1
    try:
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
    return code


def serve(control_fd: int, parent_pid: int) -> None:
    """The server's loop: fork a child per request, tell each child's exit status to its socket, end with the
    launcher (its control socket's end of file)."""
    _die_with(parent_pid)
    if setproctitle is not None:
        # Its first call moves the environment to make room for titles: here, while the environment is the one the
        # process started with (a child's title is set after its environment changed).
        setproctitle.setproctitle(f"{sys.executable} -m {_SERVER_MODULE} (tfdag's fork server of pid {parent_pid})")
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
    except BaseException as error:  # noqa: BLE001 - told to the launcher, which raises it
        control.send(f"import failed: {error!r}".encode()[:_MESSAGE_MAX])
        return
    control.send(b"ready")
    server_pid = os.getpid()
    children: dict[int, socket.socket] = {}
    spare: _SpareChild | None = None
    spares_work = True  # until a spare dies before its task: then its module's warm-up fails here

    def closed_in_a_child(*more: int) -> list[int]:
        own = [spare.channel.fileno()] if spare is not None else []
        return [control.fileno(), wake_r, wake_w, *own, *more, *(s.fileno() for s in children.values())]

    while True:
        watched = [control, wake_r] + ([spare.channel] if spare is not None and not spare.is_warm else [])
        ready, _, _ = select.select(watched, [], [])
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 512)
        while children or spare is not None:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if spare is not None and pid == spare.pid:
                spare.channel.close()
                spare, spares_work = None, False
                continue
            told = children.pop(pid, None)
            if told is not None:
                with contextlib.suppress(OSError):
                    told.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                told.close()
        if spare is not None and spare.channel in ready:
            spare.is_warm = spare.channel.recv(_MESSAGE_MAX) == _WARM  # else its end of file: it is dying, reaped above
        if control in ready:
            message, fds, _, _ = socket.recv_fds(control, _MESSAGE_MAX, 2)
            if not message:
                return  # the launcher's process is gone: exiting kills every child (their PDEATHSIG)
            out_fd, status_fd = fds
            status = socket.socket(fileno=status_fd)
            request = json.loads(message)
            pid = None
            if spare is not None and spare.fits(request):
                pid = spare.hand(message, out_fd)
                spare = None
            if pid is None:
                pid = _fork(_child, request, out_fd, closed_in_a_child(status.fileno()), server_pid)
            os.close(out_fd)
            children[pid] = status
            with contextlib.suppress(OSError):
                status.sendall(f"pid {pid}\n".encode())
            if request.get("warm") and spare is not None and spare.module != request["module"]:
                spare.discard()  # at most one spare, for the module warm launches start now
                spare = None
            if request.get("warm") and spare is None and spares_work:
                # The next warm launch's process, started now: it warms while this one's task runs.
                ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                pid = _fork(_spare, request, theirs, closed_in_a_child(ours.fileno()), server_pid)
                theirs.close()
                spare = _SpareChild(pid, ours, request["module"])


def _fork(child_fn: Callable[..., None], *args) -> int:
    """Fork; the child runs `child_fn(*args)` (which never returns), the server gets the child's pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        child_fn(*args)
    return pid


class _SpareChild:
    """The server's side of its spare: a child forked ahead that warms its module up, then waits for a task."""

    def __init__(self, pid: int, channel: socket.socket, module: str):
        self.pid, self.channel, self.module = pid, channel, module
        self.is_warm = False

    def fits(self, request: dict) -> bool:
        """A warm launch of the module it warmed, once it told it is warm (a task never waits for a warm-up)."""
        return self.is_warm and bool(request.get("warm")) and request["module"] == self.module

    def hand(self, message: bytes, out_fd: int) -> int | None:
        """Give it the task; its pid, or None when it is gone (the server forks the task itself)."""
        try:
            socket.send_fds(self.channel, [message], [out_fd])
        except OSError:
            self.discard()
            return None
        self.channel.close()
        return self.pid

    def discard(self) -> None:
        """Kill it (reaped with the server's other children, told to no one)."""
        self.channel.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
