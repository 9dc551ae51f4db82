"""``bench.process.free_port``: the port every test server and benchmark server listens on is
drawn below the kernel's ephemeral range, where no outgoing connection and no ``bind(0)`` of a
booting engine can take it between the draw and the server's own bind."""

from __future__ import annotations

import random
import socket

import pytest

from bench.process import LOWEST_PORT, ephemeral_range, free_port


def test_the_ephemeral_range_is_read_from_the_kernel(tmp_path):
    path = tmp_path / "ip_local_port_range"
    path.write_text("40000\t50000\n")
    assert ephemeral_range(path) == (40000, 50000)
    assert ephemeral_range(tmp_path / "absent") == (32768, 60999)


def test_a_free_port_lies_below_the_ephemeral_range_and_is_bindable():
    low = ephemeral_range()[0]
    if low <= LOWEST_PORT:
        pytest.skip("this kernel leaves no room below its ephemeral range")
    ports = [free_port() for _ in range(50)]
    assert all(LOWEST_PORT <= p < low for p in ports)
    assert len(set(ports)) > 40  # drawn at random, not the same port each time
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))


def test_a_port_in_use_is_never_handed_out():
    low = ephemeral_range()[0]
    if low <= LOWEST_PORT:
        pytest.skip("this kernel leaves no room below its ephemeral range")
    # Occupy the first port a seeded draw would give; the same draw must skip it.
    taken = free_port(random.Random(7))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", taken))
        holder.listen()
        assert free_port(random.Random(7)) != taken
