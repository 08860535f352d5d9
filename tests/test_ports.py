"""free_port: ports a test or `pdserve up` hands to a server process it starts."""

import socket

from pdserve.common.ports import _ephemeral_range, free_port


def test_ports_are_distinct_bindable_and_outside_the_ephemeral_range():
    low, high = _ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)  # two servers of one test never get the same port
    # The kernel hands ephemeral ports to every connect() and every bind(0) on the machine (UCX's
    # listeners among them); a port from there can be taken before the server binds it.
    assert all(not low <= p <= high for p in ports)
    for p in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_in_use_is_not_handed_out(monkeypatch):
    import pdserve.common.ports as ports

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        picks = iter([taken, taken])
        real_choice = ports.random.choice
        monkeypatch.setattr(ports.random, "choice", lambda seq: next(picks, None) or real_choice(seq))
        port = free_port()
        assert port != taken
        assert next(picks, None) is None  # it was offered the busy port and passed it over
