"""xferlib.testing's helpers that tests lean on: free_port's rendezvous ports."""

import socket

from xferlib.testing import free_port


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except OSError:
        return 32768


def test_free_port_is_bindable_and_below_the_ephemeral_range():
    start = _ephemeral_start()
    ports = [free_port() for _ in range(50)]
    assert all(max(1024, start - 12000) <= p < start for p in ports), ports
    assert len(set(ports)) > 40  # drawn at random, not one port handed out again and again
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))


def test_free_port_skips_a_port_in_use(monkeypatch):
    """A drawn port that is taken is drawn past, not returned."""
    import random

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        start = _ephemeral_start()
        draws = iter([taken, max(1024, start - 12000) + 7])
        monkeypatch.setattr(random.SystemRandom, "randrange", lambda self, a, b: next(draws))
        port = free_port()
        assert port != taken
        assert port == max(1024, start - 12000) + 7
