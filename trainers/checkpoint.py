"""Checkpoints off the critical path: copy the state now, write it in a background thread.

    critical path:  Snapshot.take(...)  every tensor copied to CPU memory (aliases kept: tied
                                        weights stay tied), small files read as bytes
    writer thread:  <dir>.tmp/ <- HF weights (save_pretrained), files, torch.save'd state
                    fsync every file and the folder -> rename <dir>.tmp to <dir> -> fsync the parent

A crash at any moment leaves, under the final name, either nothing new or the complete folder: a
``*.tmp`` folder may be half-written and nothing trusts it (infra/checkpoints.py never lists one).
One write at a time: ``submit`` first waits for the previous write; a write's error is raised by
the next ``submit`` or ``wait`` (the run fails instead of losing it).

Memory: a snapshot holds one CPU copy of the weights and the optimizer state (~3x the weights
for AdamW) until it is written.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from infra.faults import current_iteration, fault_point


class CheckpointWriteError(RuntimeError):
    """A checkpoint write failed; the message names the folder."""


def cpu_copy(obj: Any, memo: dict | None = None) -> Any:
    """``obj`` with every tensor replaced by a detached CPU copy (dicts, lists, tuples walked).

    Tensors that view the same memory (same storage, offset, shape, stride, dtype) get one shared
    copy, so tied weights stay tied and are written once, as the live model would be."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        key = (obj.untyped_storage().data_ptr(), obj.storage_offset(), tuple(obj.shape),
               tuple(obj.stride()), obj.dtype, obj.device)
        if key not in memo:
            memo[key] = obj.detach().to("cpu", copy=True)
        return memo[key]
    if isinstance(obj, dict):
        return type(obj)((k, cpu_copy(v, memo)) for k, v in obj.items())
    if isinstance(obj, list | tuple) and not hasattr(obj, "_fields"):
        return type(obj)(cpu_copy(v, memo) for v in obj)
    return obj


# the folder of a tokenizer's named chat templates (``<name>.jinja``: transformers' tool_use,
# rag, ...), beside its chat_template.jinja
CHAT_TEMPLATE_DIR = "additional_chat_templates"


def read_files(folder: Path, names: tuple[str, ...]) -> dict[str, bytes]:
    """The bytes of those of ``names`` that exist in ``folder``."""
    return {n: (folder / n).read_bytes() for n in names if (folder / n).is_file()}


@dataclass
class Snapshot:
    """Everything one checkpoint folder will hold, in CPU memory.

    ``model`` is the live HF model, used only for ``save_pretrained``'s config and format (its
    parameters are not read: ``weights`` are). ``iteration`` is the run's iteration at the time
    (for the fault points inside the write)."""

    model: Any
    weights: dict[str, torch.Tensor]
    torch_files: dict[str, Any]
    files: dict[str, bytes]
    iteration: int

    @classmethod
    def take(cls, model: torch.nn.Module, torch_files: dict[str, Any],
             files: dict[str, bytes]) -> Snapshot:
        memo: dict = {}
        return cls(model, cpu_copy(model.state_dict(), memo), cpu_copy(torch_files, memo),
                   dict(files), current_iteration())


def fsync_tree(folder: Path) -> None:
    """fsync every file under ``folder``, then the folders themselves (entries durable)."""
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for path in [*sorted(p for p in folder.rglob("*") if p.is_dir()), folder]:
        fsync_dir(path)


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_dir(final: Path) -> Path:
    return final.with_name(final.name + ".tmp")


def write_snapshot(snap: Snapshot, final: Path, hold: bool = False) -> None:
    """Write ``snap`` to ``final`` through ``final.tmp`` (fsync, then one atomic rename).

    ``hold``: a background write; its fault points hold instead of killing (infra/faults.py)."""
    tmp = tmp_dir(final)
    shutil.rmtree(tmp, ignore_errors=True)
    snap.model.save_pretrained(tmp, state_dict=dict(snap.weights))
    fault_point("during_background_write", snap.iteration, hold=hold)
    for name, data in snap.files.items():  # a name may have a folder (CHAT_TEMPLATE_DIR)
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_bytes(data)
    for name, obj in snap.torch_files.items():
        torch.save(obj, tmp / name)
    fsync_tree(tmp)
    fault_point("during_checkpoint_save", snap.iteration, hold=hold)
    shutil.rmtree(final, ignore_errors=True)  # a stale folder of the same version (re-done step)
    tmp.rename(final)
    fsync_dir(final.parent)


def snapshot_bytes(snap: Snapshot) -> int:
    """About the bytes ``snap`` takes on disk: its tensors' data and its files."""
    seen: set[int] = set()

    def size(obj: Any) -> int:
        if isinstance(obj, torch.Tensor):
            if id(obj) in seen:  # tied weights are written once
                return 0
            seen.add(id(obj))
            return obj.numel() * obj.element_size()
        if isinstance(obj, dict):
            return sum(size(v) for v in obj.values())
        if isinstance(obj, list | tuple):
            return sum(size(v) for v in obj)
        return 0
    return size(snap.weights) + size(snap.torch_files) + sum(len(b) for b in snap.files.values())


def _out_of_space(err: BaseException) -> bool:
    """An ENOSPC (or quota) OSError anywhere in ``err``'s chain."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        err = err.__cause__ or err.__context__
    return False


def space_note(final: Path, err: BaseException, needed: int) -> str:
    """``" (no space left on the device? N bytes free ...)"`` when ``err`` says so or the
    filesystem of ``final`` has less room than the checkpoint needs; else ``""``. A full disk
    does not always say ENOSPC: torch.save reported one as ``RuntimeError('[enforce fail at
    inline_container.cc:672] . unexpected pos ...')`` (review, 2026-11-29)."""
    folder = final
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return " (no space left on the device)" if _out_of_space(err) else ""
    if not _out_of_space(err) and free >= needed:
        return ""
    return (f" (no space left on the device? {free:,} bytes free at {folder}, the checkpoint "
            f"needs about {needed:,})")


class CheckpointWriter:
    """At most one checkpoint write in flight, in a daemon thread; errors are kept and raised
    by the next ``submit`` or ``wait``."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: tuple[Path, BaseException, str] | None = None  # folder, error, space_note

    @property
    def pending(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, final_dir: str | Path, snap: Snapshot, background: bool) -> None:
        """Write ``snap`` to ``final_dir``: after the previous write; in the background or now."""
        self.wait()
        final = Path(final_dir)
        if not background:
            self._write(final, snap, False)
            self._raise()
            return
        self._thread = threading.Thread(target=self._write, args=(final, snap, True),
                                        name=f"rlake-checkpoint-{final.name}", daemon=True)
        self._thread.start()

    def _write(self, final: Path, snap: Snapshot, hold: bool) -> None:
        try:
            write_snapshot(snap, final, hold)
        except BaseException as e:  # kept for the caller's thread: a lost error is a lost checkpoint
            self._error = (final, e, space_note(final, e, snapshot_bytes(snap)))

    def wait(self) -> None:
        """Block until the write in flight (if any) is on disk; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            final, err, note = self._error
            self._error = None
            raise CheckpointWriteError(f"checkpoint {final}: write failed{note}: {err!r}") from err
