"""Ports of the servers rlake starts (SGLang servers and router, Prefect's servers, rendezvous).

A port picked free (``free_port``) is free only when picked: a server binds it once it has
loaded (SGLang: 20 s and more on a busy CPU; Prefect's server: seconds), and any process on the
machine may get the same port from the OS meanwhile. The server then exits at start-up
("address already in use"); ``ready_or_moved`` starts it again on another port.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger(__name__)

# what a server (uvicorn, Python's own, Prefect's) or SGLang's router (Rust) logs when its port
# is bound already
PORT_TAKEN = "address already in use"
PORT_TRIES = 3  # launches of a server whose port another process keeps taking first

Server = TypeVar("Server")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host`` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether another socket holds ``host:port`` (binding it here fails)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
        return False


def ready_or_moved(server: Server, port: int, launch: Callable[[int], Server],
                   wait: Callable[[Server, int], None], taken: Callable[[Server, int], bool],
                   stop: Callable[[Server], None], tries: int = PORT_TRIES,
                   name: str = "a server") -> tuple[Server, int]:
    """Wait for ``server`` (launched on ``port``) with ``wait(server, port)``; when the wait
    fails and ``taken(server, port)`` says it exited because its port was taken meanwhile, stop
    it and ``launch(new_port)`` on a new free port instead, ``tries`` launches in all (1: a port
    the user gave is never moved). Returns the ready server and its port; on an error the
    server is stopped (``stop``: nothing left behind) and the error raised."""
    launches = 1
    while True:
        try:
            wait(server, port)
            return server, port
        except Exception:
            moved = launches < tries and taken(server, port)
            stop(server)
            if not moved:
                raise
        except BaseException:  # Ctrl-C or SIGTERM while it starts
            stop(server)
            raise
        log.warning("%s: port %d was taken before it bound it; starting it on another", name, port)
        port = free_port()
        server = launch(port)
        launches += 1
