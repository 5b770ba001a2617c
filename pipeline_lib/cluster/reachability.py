"""Reachability before TensorFlow's server exists: a plain TCP listener on this task's port and a probe of every peer's."""

from __future__ import annotations

import concurrent.futures
import selectors
import socket
import threading
import time

from pipeline_lib.cluster.address import split_address
from pipeline_lib.cluster.preflight_report import PreflightError

CONNECT_RETRY_S = 0.2


class Listener:
    """A plain TCP listener on this task's port so peers can check it before TensorFlow's server exists.

    Accepted connections are closed only after the peer closes them, so no TIME_WAIT is left on this
    port's side and the TF server can bind it at once.
    """

    def __init__(self, port: int, task: str, address: str):
        family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
        try:
            self.sock = socket.create_server(("", port), family=family, backlog=128,
                                             dualstack_ipv6=family == socket.AF_INET6)
        except OSError as error:
            raise PreflightError(
                f"{task} cannot listen on port {port} of its TF_CONFIG address {address!r}: {error}; another "
                f"process on this host holds it (a second task claiming {task}, or a TF server still running): "
                "stop it or give the task a free port"
            ) from None
        self.sock.setblocking(False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"preflight-listener-{port}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.sock, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                for key, _mask in selector.select(timeout=0.05):
                    if key.fileobj is self.sock:
                        try:
                            conn, _addr = self.sock.accept()
                        except (BlockingIOError, OSError):
                            continue
                        conn.setblocking(False)
                        selector.register(conn, selectors.EVENT_READ)
                    else:
                        try:
                            data = key.fileobj.recv(64)
                        except (BlockingIOError, InterruptedError):
                            continue
                        except OSError:
                            data = b""
                        if not data:
                            selector.unregister(key.fileobj)
                            key.fileobj.close()
        finally:
            for key in list(selector.get_map().values()):
                if key.fileobj is not self.sock:
                    key.fileobj.close()
            selector.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


def _connect_error(address: str, deadline: float) -> str | None:
    """None when host:port accepts a TCP connection before the deadline, else why not."""
    host, port = split_address(address)
    last = "no attempt was made"
    while True:
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except socket.gaierror as error:
            last = f"host {host!r} does not resolve ({error})"
        else:
            for family, kind, proto, _name, sockaddr in infos:
                try:
                    with socket.socket(family, kind, proto) as sock:
                        sock.settimeout(max(0.1, min(1.0, deadline - time.monotonic())))
                        sock.connect(sockaddr)
                    return None
                except OSError as error:
                    last = f"{sockaddr[0]}:{sockaddr[1]} refused or timed out ({type(error).__name__}: {error})"
        if time.monotonic() + CONNECT_RETRY_S >= deadline:
            return last
        time.sleep(CONNECT_RETRY_S)


def check_peers(peers: dict[str, str], deadline: float) -> dict[str, str | None]:
    if not peers:
        return {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(peers))) as pool:
        futures = {task: pool.submit(_connect_error, address, deadline) for task, address in peers.items()}
        return {task: future.result() for task, future in futures.items()}
