"""The prompt file a run started with, recorded so that a resume reads the same one.

A run's data position counts prompts in its file's order (``rollout.data.PromptDataset``): a
resume after the file was edited, replaced or shuffled differently went on from the same count
in other rows, silently (review, 2026-11-29: iterations 3-5 trained on the new prompts, and
``row`` meant other prompts within one run). The run's row records the file's SHA-256
(``notes["prompt_data"]``); ``rlake resume`` refuses a file that differs.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def prompt_data_digest(prompt_data: str | None) -> dict | None:
    """{"path", "sha256"} of ``data.prompt_data``'s file (its ``@[a:b]`` slice aside); None for
    built-in data (made from the seed)."""
    if not prompt_data:
        return None
    from rollout.data import parse_data_path

    path = parse_data_path(prompt_data)[0]
    return {"path": path, "sha256": file_sha256(path)}


def changed_prompt_data(recorded: dict | None, prompt_data: str | None) -> str | None:
    """Why the run cannot go on with ``prompt_data`` as it is now, or None (same file, or a run
    recorded before digests)."""
    if not recorded:
        return None
    now = prompt_data_digest(prompt_data)
    if now is not None and now["sha256"] == recorded["sha256"]:
        return None
    return (f"data.prompt_data {recorded['path']} changed since the run started (SHA-256 "
            f"{recorded['sha256'][:12]}..., now {now['sha256'][:12] if now else 'none'}...): the "
            "run's data position counts prompts in that file, so going on would read other rows. "
            "Put the file back as it was, or start a new run (model.path = this run's last "
            "checkpoint)")
