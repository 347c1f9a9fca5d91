"""Which checkpoints a run writes, trusts, rebuilds from and may delete (rules; the only I/O is
folder listings, and ``checkpoint_problem``'s reading of file headers).

A weight version is committed by its ``train_steps`` row (the lake is the write-ahead log); a
checkpoint is a shortcut to a committed version:

- saved: v0, every ``save_interval``-th version, the run's last one (and every version when the
  engine can only load weights from disk);
- trusted on resume: the newest complete folder at or below the committed version (``*.tmp``
  folders and versions above the commit are never trusted); one whose files cannot be read
  (``checkpoint_problem``) is set aside as ``vNNNNNN.unusable`` and the next older one used;
- rebuilt: the committed versions above it, by re-training each committed step on exactly the
  samples its row names (no generation);
- pruned: never the one a resume needs, never v0 while the reference needs it, never one above
  the commit.
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

CHECKPOINT_RE = re.compile(r"^v(\d{6,})$")


def checkpoint_due(iteration: int, total: int, save_interval: int) -> bool:
    """Whether iteration ``iteration`` (producing version iteration + 1) saves a checkpoint:
    (iteration + 1) % save_interval == 0, or it is the last of ``total`` iterations."""
    return (iteration + 1) % save_interval == 0 or iteration + 1 >= total


def saved_versions(root: Path) -> list[int]:
    """Versions with a complete checkpoint folder under ``root`` (``vNNNNNN``; a ``.tmp`` folder
    is a write that never finished its rename), ascending."""
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir()
                  if p.is_dir() and (m := CHECKPOINT_RE.match(p.name)))


def resume_checkpoint(saved: list[int], committed: int) -> int | None:
    """The newest saved version at or below ``committed`` (None: there is none)."""
    return max((v for v in saved if v <= committed), default=None)


def prunable(saved: list[int], committed: int, keep_last: int, keep_v0: bool) -> list[int]:
    """Saved versions that may be deleted: below ``committed``, not among the newest
    ``keep_last``, not the one a resume needs (``resume_checkpoint``), not v0 if ``keep_v0``."""
    keep = set(saved[-keep_last:]) | {resume_checkpoint(saved, committed)}
    if keep_v0:
        keep.add(0)
    return [v for v in saved if v < committed and v not in keep]


def stale_folders(root: Path, committed: int) -> list[Path]:
    """Folders a crash left that no resume may trust: ``*.tmp`` writes and checkpoints of
    versions above the commit (saved before their train_steps row was written)."""
    if not root.is_dir():
        return []
    out = []
    for p in sorted(root.iterdir()):
        m = CHECKPOINT_RE.match(p.name)
        if p.is_dir() and (p.name.endswith(".tmp") or (m and int(m.group(1)) > committed)):
            out.append(p)
    return out


def rebuild_chain(steps: list[dict], start: int, committed: int) -> list[dict]:
    """The committed train_steps rows that turn version ``start`` into ``committed``, in order:
    each row's base_version is the previous row's weight_version. A gap is a ValueError."""
    by_base = {s["base_version"]: s for s in steps if s["weight_version"] > start}
    chain, v = [], start
    while v < committed:
        step = by_base.get(v)
        if step is None:
            raise ValueError(f"no committed train step from weight version {v}: cannot rebuild "
                             f"version {committed} from checkpoint v{start}")
        chain.append(step)
        v = step["weight_version"]
    return chain


def checkpoint_problem(folder: Path, state_files: list[str]) -> str | None:
    """Why the checkpoint ``folder`` cannot be resumed from, or None: its config.json and the
    headers of its weights readable (``infra.startup.unreadable_model_file``, milliseconds),
    and each of ``state_files`` (the trainer's: optimizer, RNG, critic) there, a ``.pt`` one
    a whole zip archive (its directory sits at the end: a truncated file has none). Unchecked,
    a damaged newest folder stopped the resume with an error naming no file, and one without
    its optimizer state resumed with a fresh optimizer and ended elsewhere than an uninterrupted
    run, without a word (review, 2026-11-29)."""
    from infra.startup import not_a_model_folder, unreadable_model_file

    why = not_a_model_folder(folder) or unreadable_model_file(folder)
    if why:
        return why.replace("model.path: ", "").replace("model.path ", "")
    for name in state_files:
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        if path.suffix == ".pt":
            try:
                zipfile.ZipFile(path).close()
            except (zipfile.BadZipFile, OSError) as e:
                return f"{path} is not readable ({e})"
    return None


def set_aside(folder: Path) -> Path:
    """Rename a checkpoint folder no resume may use to ``NAME.unusable`` (``.unusable.2``, ...
    if taken): kept for a look, never trusted, pruned or written over (no checkpoint name)."""
    target, n = folder.with_name(folder.name + ".unusable"), 1
    while target.exists():
        n += 1
        target = folder.with_name(f"{folder.name}.unusable.{n}")
    folder.rename(target)
    return target
