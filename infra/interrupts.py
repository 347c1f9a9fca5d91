"""Ctrl-C remembered for the whole process.

Prefect's flow engine swallows a ``KeyboardInterrupt`` that lands once a flow run has reached
its final state (in its teardown or an ``on_completion`` hook it logs "BaseException was raised
after user code finished executing" and returns normally: Prefect 3.8.8, reproduced in
tests/test_interrupts.py). A Ctrl-C there was lost: the run trained on to its end (a CI run of
tests/test_hardening_run.py, 2026-11-29). The CLI's SIGINT handler notes every Ctrl-C here
(``note_interrupts``), and whoever calls a flow raises a noted one again when the call returns
(``raise_noted_interrupt``: ``flows.prefetch.IterationRuns.run``; ``flow_call`` for a single
flow, the SFT warm-up's)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_NOTED = threading.Event()


def note_interrupts() -> None:
    """Ctrl-C raises ``KeyboardInterrupt`` as before, and is remembered (``interrupt_noted``).
    A SIGINT that is ignored (a background job) or someone else's handler is left alone."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return

    def on_sigint(signum: int, frame: object) -> None:
        _NOTED.set()
        signal.default_int_handler(signum, frame)

    signal.signal(signal.SIGINT, on_sigint)


def interrupt_noted() -> bool:
    """Whether this process got a Ctrl-C (through ``note_interrupts``' handler)."""
    return _NOTED.is_set()


def raise_noted_interrupt() -> None:
    """``KeyboardInterrupt`` if this process got a Ctrl-C: one a flow engine swallowed is not lost."""
    if _NOTED.is_set():
        raise KeyboardInterrupt


def flow_call(flow: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``flow(*args, **kwargs)`` (a Prefect flow call), then ``raise_noted_interrupt``: a Ctrl-C
    the engine swallowed in the run's teardown stops the caller here, not at the next guarded
    call (the SFT warm-up's went on into RL until the first iteration's end)."""
    result = flow(*args, **kwargs)
    raise_noted_interrupt()
    return result
