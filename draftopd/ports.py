"""A free port, picked by the OS: for a server's own listener, a replica, or a group whose store a rank hosts."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now ("" : every interface of this node)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
