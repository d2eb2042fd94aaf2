"""The rendezvous port of spawned processes is drawn below the kernel's range for outgoing connections."""

import socket

from lightning_gradcomp.demo import ports


def test_a_port_is_drawn_below_the_range_for_outgoing_connections_and_is_free():
    start = ports._ephemeral_start()
    drawn = {ports.free_port() for _ in range(50)}
    # inside the range, a connection elsewhere on the machine can be given the port before the store binds it
    assert all(max(1024, start - ports._SPAN) <= port < start for port in drawn)
    assert len(drawn) > 40  # drawn at random, not a fixed port two launches would share
    for port in drawn:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_returned(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        # a range of exactly 100 ports below a pretended range start, the taken port among them
        monkeypatch.setattr(ports, "_ephemeral_start", lambda: taken + 50)
        monkeypatch.setattr(ports, "_SPAN", 100)
        assert all(ports.free_port() != taken for _ in range(200))


def test_without_room_below_the_range_the_kernel_chooses(monkeypatch):
    monkeypatch.setattr(ports, "_ephemeral_start", lambda: 1030)
    port = ports.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    assert port >= 1024
