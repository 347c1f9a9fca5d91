"""The Prefect server a bench's runs use: the one a run of the CLI has.

``flows.rl.rl_run`` called from a script without ``PREFECT_API_URL`` gets Prefect's own
temporary server, which differs from rlake's embedded one (``infra.prefect_server``): Prefect's
own app, without ``infra.prefect_app``'s fix of the 60 s stall (docs/async-log.md), no
template database, and it outlives a killed bench. The benches start rlake's instead, shared by their runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from infra.env import set_environment
from infra.prefect_server import EmbeddedServer
from infra.startup import drain_prefect_clients_if_used


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
            drain_prefect_clients_if_used()  # while the server still answers
            server.stop()
