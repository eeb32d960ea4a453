"""The ranks' rendezvous port: free, and below the kernel's ephemeral range, so that no
outgoing connection takes it between its choice and rank 0's bind."""

from __future__ import annotations

import socket

from sonar.executor import multiproc


def test_the_port_is_free_and_below_the_ephemeral_range(monkeypatch) -> None:
    monkeypatch.setattr(multiproc, "_ephemeral_low", lambda: 32768)
    for _ in range(20):
        port = multiproc._rendezvous_port()
        assert multiproc.RENDEZVOUS_PORT_FLOOR <= port < 32768
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))  # free: rank 0 can listen on it


def test_a_port_in_use_is_passed_over(monkeypatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert not multiproc._port_free(taken.getsockname()[1])
    tried: list[int] = []
    free = multiproc._port_free
    monkeypatch.setattr(multiproc, "_port_free", lambda port: tried.append(port) or (len(tried) > 3 and free(port)))
    monkeypatch.setattr(multiproc, "_ephemeral_low", lambda: 32768)
    port = multiproc._rendezvous_port()
    assert len(tried) >= 4 and port == tried[-1]  # the candidates found taken were skipped


def test_without_the_range_the_kernel_chooses(monkeypatch) -> None:
    monkeypatch.setattr(multiproc, "PORT_RANGE_FILE", "/nonexistent/ip_local_port_range")
    assert multiproc._ephemeral_low() is None
    assert 0 < multiproc._rendezvous_port() < 65536
