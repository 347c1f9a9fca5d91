"""The Prefect server a bench's runs use: the one a run of the CLI has.

``flows.rl.rl_run`` called from a script without ``PREFECT_API_URL`` gets Prefect's own
temporary server, which differs from rlake's embedded one (``infra.prefect_server``): SQLite's
60 s busy timeout instead of 5 s (docs/operations.md: the 60 s stall), no template database,
and it outlives a killed bench. The benches start rlake's instead, shared by their runs.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from infra.env import set_environment
from infra.prefect_server import EmbeddedServer


@contextmanager
def embedded_prefect(home: str | Path) -> Iterator[None]:
    """rlake's environment for ``home`` (before Prefect is imported: it reads its settings
    then), and the embedded server started there and waited for; stopped on the way out (after
    Prefect's clients sent what they hold). A ``PREFECT_API_URL`` already set wins."""
    set_environment(home)
    server = EmbeddedServer.start(home)
    try:
        if server is not None:
            server.wait()
        yield
    finally:
        if server is not None:
            if "flows.durability" in sys.modules:  # a run used Prefect: its clients may hold records
                from flows.durability import drain_prefect_clients

                drain_prefect_clients()  # while the server still answers
            server.stop()
