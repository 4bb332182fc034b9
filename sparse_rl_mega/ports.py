"""Free TCP ports on this host (torchrun's rendezvous, the weight-update group)."""
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
