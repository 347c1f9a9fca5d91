"""``python -m tests.signal_at MOMENT ARGS...``: the real `rlake ARGS...`, which sends itself a
SIGTERM at one exact moment of `rlake serve` (a moment a signal from outside hits only by
chance). Nothing is replaced: the real call runs right after the signal.

- ``registering``: as the serve registers its first deployment, before Prefect's Runner starts;
- ``runner-entering``: inside the Runner's start, after it entered its task groups and before
  it is started (held 1 s there, so the stop is asked while it is half-way).

A SIGTERM once it serves is tests/test_deploy.py's stop.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys


def _signal_self(moment: str) -> None:
    print(f"signal_at: SIGTERM at {moment}", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)


def _patch(moment: str) -> None:
    from prefect._internal.observers import FlowRunCancellingObserver
    from prefect.runner import Runner

    if moment == "registering":
        real_add = Runner.aadd_deployment

        async def aadd_deployment(self, *args, **kwargs):
            _signal_self(moment)
            return await real_add(self, *args, **kwargs)

        Runner.aadd_deployment = aadd_deployment
    elif moment == "runner-entering":
        real_enter = FlowRunCancellingObserver.__aenter__  # the last step of Runner.__aenter__

        async def enter(self):
            _signal_self(moment)
            await asyncio.sleep(1.0)
            return await real_enter(self)

        FlowRunCancellingObserver.__aenter__ = enter
    else:
        raise SystemExit(f"signal_at: unknown moment {moment!r}")


if __name__ == "__main__":
    from infra import cli  # first: it sets rlake's environment before Prefect is imported

    _patch(sys.argv[1])
    sys.argv = ["rlake", *sys.argv[2:]]
    cli.main()
