"""pearlctl.agent.workers.free_port never hands out one port twice in a row, even when the kernel does (the seam
faked here is the socket: it binds to the ports listed)."""

from __future__ import annotations

import socket

from pearlctl.agent import workers


class FakeSocket:
    ports: list[int] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def bind(self, addr):
        self.port = FakeSocket.ports.pop(0)

    def getsockname(self):
        return ("0.0.0.0", self.port)


def test_a_port_the_kernel_hands_out_again_is_skipped(monkeypatch):
    monkeypatch.setattr(workers, "_HANDED", workers.collections.deque(maxlen=1024))
    monkeypatch.setattr(socket, "socket", FakeSocket)
    FakeSocket.ports = [41000, 41000, 41000, 41001, 41002]
    assert [workers.free_port(), workers.free_port(), workers.free_port()] == [41000, 41001, 41002]
    assert FakeSocket.ports == []


def test_real_ports_in_a_burst_are_all_different():
    ports = [workers.free_port() for _ in range(200)]
    assert len(set(ports)) == 200
