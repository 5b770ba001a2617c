"""The one rule for a cluster address: `host:port` with a hostname, IPv4 or bracketed IPv6 host and a port 1..65535.

TF_CONFIG written by a user (`tfdag validate-cluster`, the worker's cluster check) and the cluster specs the
launchers generate are both checked by `address_problem`, so a launcher cannot hand a worker an address the static
rules would have refused.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from typing import Any

from pipeline_lib.cluster.report import ClusterConfigError, error, format_findings

# RFC 1123 hostname labels: letters, digits and inner hyphens, 1..63 characters each, 253 in all.
_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


@dataclasses.dataclass(frozen=True)
class AddressProblem:
    """Why an address cannot work: the finding's rule id and the text that follows the address in its message."""

    rule: str
    text: str


def split_address(address: str) -> tuple[str, str | None]:
    """('host', 'port') of 'host:port' or '[v6]:port'; port None when there is none (port stays a string)."""
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        return host, rest[1:] if rest.startswith(":") else None
    host, sep, port = address.rpartition(":")
    return (host, port) if sep else (address, None)


def _host_problem(host: str, bracketed: bool) -> str | None:
    """Why `host` is not a hostname, an IPv4 address or (bracketed) an IPv6 address; None when it is one."""
    if bracketed:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return f"has [{host}] in brackets, which is not an IPv6 address"
        return None
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return f"has host {host!r}, which is not a hostname or an IP address"
        return f"has the IPv6 host {host!r} without brackets"
    if re.fullmatch(r"[0-9.]+", host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return f"has host {host!r}, which is not an IPv4 address"
        return None
    if len(host) > 253 or not all(_LABEL.match(label) for label in host.removesuffix(".").split(".")):
        return (f"has host {host!r}, which is not a valid hostname (letters, digits, '-' and '.', each label "
                "1-63 characters)")
    return None


def address_problem(address: Any) -> AddressProblem | None:
    """Why `address` cannot be a cluster address, or None when it is a valid `host:port`.

    Returns:
        None, or the problem: `address_without_port` (not a string, no port, no host), `address_not_host_port`
        (a URL scheme, whitespace, a path), `address_bad_host`, `port_not_numeric` or `port_out_of_range`.
    """
    if not isinstance(address, str):
        return AddressProblem("address_without_port", f"is {address!r}, not a 'host:port' string; quote it as "
                                                      '"host:port"')
    if address != address.strip() or any(c.isspace() for c in address):
        return AddressProblem("address_not_host_port", f"contains whitespace; remove it: {''.join(address.split())!r}")
    scheme = _SCHEME.match(address)
    if scheme:
        bare = address[scheme.end():].split("/", 1)[0] or "host:2222"
        return AddressProblem("address_not_host_port", f"starts with the URL scheme {scheme.group(0)!r}; TF_CONFIG "
                                                       f"takes a bare host:port, e.g. {bare!r}")
    if "/" in address:
        bare = address.split("/", 1)[0] or "host:2222"
        return AddressProblem("address_not_host_port", f"has a path; TF_CONFIG takes a bare host:port, e.g. {bare!r}")
    host, port = split_address(address)
    if port is None or not host:
        part = "port" if port is None else "host"
        return AddressProblem("address_without_port", f"has no {part}; write it as host:port, e.g. "
                                                      f"'{host or 'worker-0'}:{port or 2222}'")
    if not port.isdigit():
        return AddressProblem("port_not_numeric", f"has port {port!r}, not a number; use a numeric port, e.g. "
                                                  f"'{host}:2222'")
    if not 1 <= int(port) <= 65535:
        return AddressProblem("port_out_of_range", f"has port {int(port)}, outside 1..65535; choose a real port (0 "
                                                   "would pick a random one that peers cannot know)")
    problem = _host_problem(host, address.startswith("["))
    if problem is not None:
        return AddressProblem("address_bad_host", f"{problem}; use a hostname, an IPv4 address or an IPv6 address "
                                                  "in brackets, e.g. '[::1]:2222'")
    return None


def cluster_address_problems(cluster: dict[str, Any], who: str) -> list[tuple[str, str]]:
    """(rule, message) for every bad address of a cluster spec (`{job: [address, ...]}`), each naming its task.

    Args:
        cluster: the cluster spec, as in TF_CONFIG.
        who: how messages name the spec: "TF_CONFIG of worker 1", "the Ray launcher's cluster".
    """
    found = []
    for job, addresses in cluster.items():
        if not isinstance(addresses, (list, tuple)):
            continue
        for index, address in enumerate(addresses):
            problem = address_problem(address)
            if problem is None:
                continue
            shown = "" if not isinstance(address, str) else f" {address!r}"
            message = f"{who}: cluster.{job}[{index}]{shown} {problem.text}"
            found.append((problem.rule, message))
    return found


def validate_cluster_addresses(cluster: dict[str, Any], who: str) -> None:
    """Raise before anything starts when any address of a generated or given cluster spec is not a `host:port`.

    Raises:
        ClusterConfigError: listing every bad address with its task, its value and the fix.
    """
    found = [error(rule, message) for rule, message in cluster_address_problems(cluster, who)]
    if found:
        raise ClusterConfigError(format_findings(found, who), found)
