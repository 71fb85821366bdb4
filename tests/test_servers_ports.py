"""tools/servers.free_port: ports for the servers the tests and benchmarks start."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import servers  # tools/, on the path through tests/conftest.py


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [servers.free_port() for _ in range(50)]
    assert len(set(ports)) == 50  # never the same port twice in one process
    for port in ports:
        assert 10000 <= port < first_ephemeral  # no outgoing connection is given it
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    # A window of 25 ports: hold the first 20, then ask for five.
    lo = servers.free_port()
    monkeypatch.setattr(servers, "ports_below_ephemeral_range", lambda: (lo, lo + 25))
    held = []
    try:
        for port in range(lo, lo + 20):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
                held.append(s)
            except OSError:  # taken already, which is as good
                s.close()
        wanted = [p for p in range(lo + 20, lo + 25) if p not in servers._HANDED_OUT]
        got = {servers.free_port() for _ in wanted}
        assert got == set(wanted)
    finally:
        for s in held:
            s.close()
