"""Ready-built SQLite databases (and other files or folders) kept in rlake's cache and copied in.

A database whose empty state depends only on an installed package (Prefect's server database
after its migrations, MLflow's tracking database after its own) costs seconds to build in every
fresh home. The first build on a machine leaves a copy in the cache; later homes copy that.

    {cache}/<kind>/<package>-<version>[...].db

``{cache}`` is ``$RLAKE_CACHE_DIR``, else ``$XDG_CACHE_HOME/rlake``, else ``~/.cache/rlake``.
Templates are written once, under a file lock, to a temporary name renamed into place; a home
gets its copy the same way, so no reader ever sees half a database. Another package version has
another file name: an old template is never used. Nothing here imports the packages.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sqlite3
from collections.abc import Callable
from importlib import metadata
from pathlib import Path


def cache_dir() -> Path:
    """rlake's cache folder: ``$RLAKE_CACHE_DIR``, ``$XDG_CACHE_HOME/rlake`` or ``~/.cache/rlake``."""
    if os.environ.get("RLAKE_CACHE_DIR"):
        return Path(os.environ["RLAKE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rlake"


def template_path(kind: str, dists: tuple[str, ...]) -> Path:
    """``{cache}/{kind}/{dist}-{version}-...db`` for the installed ones of ``dists``."""
    parts = []
    for dist in dists:
        try:
            parts.append(f"{dist}-{metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    return cache_dir() / kind / ("-".join(parts) + ".db")


def copy_in(template: Path, target: Path) -> bool:
    """Copy ``template`` (a file or a folder) to ``target`` (atomically) when the target does not
    exist and the template does; True when copied."""
    if target.exists() or not template.exists():
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    if template.is_dir():
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(template, tmp)
    else:
        shutil.copyfile(template, tmp)
    os.replace(tmp, target)
    return True


def write_once(template: Path, write: Callable[[Path], None], wait: bool) -> bool:
    """``write(tmp)`` then rename it to ``template``, unless the template exists; under the
    cache's lock (``wait`` False: give up when another process holds it). True when written."""
    if template.exists():
        return False
    template.parent.mkdir(parents=True, exist_ok=True)
    with open(template.parent / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:  # another process writes it now
            return False
        if template.exists():
            return False
        tmp = template.with_name(f".{template.name}.{os.getpid()}.tmp")
        try:
            write(tmp)
            os.replace(tmp, template)
        finally:
            if tmp.is_dir():  # a folder ``write`` left half-built
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
    return True


def backup_to(source: Path) -> Callable[[Path], None]:
    """A ``write`` for ``write_once``: a consistent copy of the live database ``source``
    (SQLite's backup API; its owner may be writing), as one self-contained file."""
    def write(tmp: Path) -> None:
        src, dst = sqlite3.connect(source), sqlite3.connect(tmp)
        try:
            src.backup(dst)
            dst.execute("PRAGMA journal_mode=DELETE")  # a WAL database's file alone is whole
        finally:
            dst.close()
            src.close()
    return write
