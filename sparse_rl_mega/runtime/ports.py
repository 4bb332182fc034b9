"""Free TCP ports on this host (torchrun's rendezvous, the weight-update group).

A port the OS picks (``bind(("", 0))``) comes from its ephemeral range, the same range it hands out as
the local port of every new outgoing connection: between the check here and the listener's bind (a
torchrun agent binds seconds later, after importing torch) any connection on the host can take it,
and the rendezvous fails with EADDRINUSE (seen in the suite with two jobs side by side). Ports below
that range are only ever taken by an explicit bind, so one is picked there, at random."""
import random
import socket

LOWEST = 20000  # below: well-known and registered services more often
_DEFAULT_EPHEMERAL = (32768, 60999)  # Linux's default ip_local_port_range


def ephemeral_range() -> tuple[int, int]:
    """The range the OS assigns to outgoing connections (Linux: ``ip_local_port_range``)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now, below the ephemeral range (random, from the system's entropy:
    processes seeded alike do not pick alike); the OS's pick where that range leaves no room."""
    low, _ = ephemeral_range()
    if low - LOWEST >= 1000:
        pick = random.SystemRandom()
        for _ in range(200):
            port = pick.randrange(LOWEST, low)
            if _bindable(host, port):
                return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
