"""Free ports on loopback: distinct, bindable, and a held port is reported taken."""

from __future__ import annotations

import socket

from pipeline_lib.core import net


def test_free_ports_are_distinct_and_bindable():
    ports = net.free_ports(5)
    assert len(set(ports)) == 5 and all(0 < p < 65536 for p in ports)
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((net.LOOPBACK, port))
    assert net.free_ports(0) == []


def test_a_port_in_use_is_not_free():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind((net.LOOPBACK, 0))
        busy.listen()
        taken = busy.getsockname()[1]
        assert not net.is_port_free(taken)
    assert net.is_port_free(taken)
    port = net.free_port()
    assert net.is_port_free(port)


def test_ports_are_picked_below_the_ephemeral_range_and_never_twice_in_a_row():
    """The OS hands out ephemeral ports for every outgoing connection: a TF_CONFIG port picked there was taken by
    another process before the worker bound it ("Address already in use")."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as file:
        ephemeral_low = int(file.read().split()[0])
    first, second = net.free_ports(20), net.free_ports(20)
    assert all(p < ephemeral_low for p in first + second)
    assert not set(first) & set(second)
