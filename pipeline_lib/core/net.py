"""Local TCP ports: whether one is free, and free ones to hand to a process that binds them later.

A port picked now and bound seconds later (a worker's TF_CONFIG address, after TensorFlow loaded; a server's port,
after it imported) can be taken in between. Ports the OS hands out for `bind(0)` and for every outgoing
connection come from the ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`, 32768-60999 by default), so
on a busy machine (servers, clients, a parallel test suite) one of them is taken again within seconds: a worker
then died with "Address already in use". `free_ports` therefore picks below that range, where only another
explicit pick can land, and at random, so two processes picking at once rarely meet; it never hands out the same
port twice within `_HELD_S` in one process (parallel launches in one process, e.g. tuning trials). Ray's own
worker ports (10002-19999 by default) are avoided too.
"""

from __future__ import annotations

import random
import socket
import threading
import time

LOOPBACK = "127.0.0.1"

_PICK_RANGE = (20000, 32767)  # above Ray's default worker ports, below the default ephemeral range
_HELD_S = 120.0  # a port handed out is not handed out again by this process for this long
_handed_out: dict[int, float] = {}
_lock = threading.Lock()
_random = random.SystemRandom()


def is_port_free(port: int, host: str = LOOPBACK) -> bool:
    """True when nothing holds `port` on `host` right now (a bind succeeds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _pick_range() -> tuple[int, int]:
    """`_PICK_RANGE`, ending below the ephemeral range when this machine's starts lower."""
    low, high = _PICK_RANGE
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as file:
            ephemeral_low = int(file.read().split()[0])
    except (OSError, ValueError, IndexError):
        return low, high
    return low, min(high, ephemeral_low - 1)


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """`count` distinct ports free on `host` right now, outside the ephemeral range (see the module docstring).

    Falls back to ports the OS picks when the range holds no free one (a machine whose ephemeral range starts
    below it).
    """
    low, high = _pick_range()
    picked: list[int] = []
    with _lock:
        now = time.monotonic()
        for port, at in list(_handed_out.items()):
            if now - at > _HELD_S:
                del _handed_out[port]
        for _ in range(200 * max(count, 1) if high > low else 0):
            if len(picked) == count:
                break
            port = _random.randint(low, high)
            if port in _handed_out or port in picked or not is_port_free(port, host):
                continue
            picked.append(port)
        if len(picked) < count:
            picked += _os_ports(count - len(picked), host, exclude=set(picked))
        for port in picked:
            _handed_out[port] = now
    return picked


def _os_ports(count: int, host: str, exclude: set[int]) -> list[int]:
    """`count` ports the OS picks (bound together, so distinct), none in `exclude`."""
    sockets: list[socket.socket] = []
    try:
        ports: list[int] = []
        while len(ports) < count:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
            if port not in exclude:
                ports.append(port)
        return ports
    finally:
        for sock in sockets:
            sock.close()


def free_port(host: str = LOOPBACK) -> int:
    """One port free on `host` right now (see `free_ports`)."""
    return free_ports(1, host)[0]
