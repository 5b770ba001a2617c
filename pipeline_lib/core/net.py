"""Local TCP ports: whether one is free, and free ones the OS picks."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def is_port_free(port: int, host: str = LOOPBACK) -> bool:
    """True when nothing holds `port` on `host` right now (a bind succeeds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """`count` distinct ports free on `host` right now (the OS picks them).

    Every socket stays bound until all are picked, so the OS cannot hand out the same port twice.
    """
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port(host: str = LOOPBACK) -> int:
    """One port free on `host` right now (the OS picks it)."""
    return free_ports(1, host)[0]
