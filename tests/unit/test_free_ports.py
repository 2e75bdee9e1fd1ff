"""The test world's port picking: ``testenv.cluster.free_ports``."""

from __future__ import annotations

import socket

from testenv.cluster import free_ports


def test_ports_chosen_together_are_distinct_and_free() -> None:
    """A service given several ports (SeaweedFS takes ten) must never get one twice:
    ports picked one at a time, each released at once, can repeat."""
    for _ in range(20):
        ports = free_ports(10)
        assert len(set(ports)) == 10, ports
        for port in ports:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", port))
