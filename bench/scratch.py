"""Scratch folders for benchmarks, removed when the bench process exits.

A bench's homes hold a lake, checkpoints and Prefect's and MLflow's databases (an async bench
run: ~165 MB); left in /tmp, a day of measuring filled it with dozens of them.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile


def scratch_dir(prefix: str) -> str:
    """A new temporary folder, removed at this process's exit (after the servers a bench started
    there: ``atexit`` runs handlers in reverse order of registration, Prefect's come later)."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
