"""A ready Prefect server database, copied into a fresh home instead of built there.

On a fresh home Prefect's server creates its SQLite database, runs its migrations and registers
its block types before it answers: seconds of every first start. All of it depends only on the
installed Prefect, so the first server on a machine (per Prefect version) leaves a copy of its
database in the cache, and later fresh homes start from that copy with both steps off:

    seed_database(phome)   before the server starts: a fresh home gets the template (True)
    save_template(phome)   after a server built its database itself: keep it as the template

    {cache}/prefect-db/prefect-<version>[-prefect-ray-<version>].db

where ``{cache}`` is ``$RLAKE_CACHE_DIR``, else ``$XDG_CACHE_HOME/rlake``, else
``~/.cache/rlake``. Safe under concurrent starts: the template is written once, under a file
lock, to a temporary name and renamed into place; a home gets its copy the same way. A new
Prefect version has another file name, so an old template is never used. Set
``RLAKE_PREFECT_DB_TEMPLATE=0`` to build every database from scratch. Nothing here imports
Prefect (it runs before Prefect's settings are read).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sqlite3
from importlib import metadata
from pathlib import Path

DB_NAME = "prefect.db"
# the server's start-up steps a template already holds the result of
FROM_TEMPLATE_ENV = {"PREFECT_API_DATABASE_MIGRATE_ON_START": "false",
                     "PREFECT_API_BLOCKS_REGISTER_ON_START": "false"}


def cache_dir() -> Path:
    """rlake's cache folder: ``$RLAKE_CACHE_DIR``, ``$XDG_CACHE_HOME/rlake`` or ``~/.cache/rlake``."""
    if os.environ.get("RLAKE_CACHE_DIR"):
        return Path(os.environ["RLAKE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rlake"


def template_path() -> Path:
    """The template for the installed Prefect (and prefect-ray, which registers blocks too)."""
    parts = []
    for dist in ("prefect", "prefect-ray"):
        try:
            parts.append(f"{dist}-{metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    return cache_dir() / "prefect-db" / ("-".join(parts) + ".db")


def enabled() -> bool:
    """Templates apply to the default database only (a configured one is the user's)."""
    return (os.environ.get("RLAKE_PREFECT_DB_TEMPLATE", "1") != "0"
            and not os.environ.get("PREFECT_API_DATABASE_CONNECTION_URL")
            and not os.environ.get("PREFECT_SERVER_DATABASE_CONNECTION_URL"))


def seed_database(phome: Path) -> bool:
    """Give a fresh Prefect home (no database yet) a copy of the template, if there is one;
    True when it did (the server then skips migrations and block registration:
    ``FROM_TEMPLATE_ENV``). The caller holds the home's start lock."""
    target, template = Path(phome) / DB_NAME, template_path()
    if not enabled() or target.exists() or not template.exists():
        return False
    tmp = target.with_name(f".{DB_NAME}.{os.getpid()}.tmp")
    shutil.copyfile(template, tmp)
    os.replace(tmp, target)  # atomic: the server never sees half a database
    return True


def save_template(phome: Path) -> bool:
    """Keep the database a server just built in ``phome`` (migrated, blocks registered) as the
    template, unless one exists or another process is writing it; True when written. A
    consistent copy of the live database (SQLite's backup API: the server may be writing)."""
    template = template_path()
    source = Path(phome) / DB_NAME
    if not enabled() or template.exists() or not source.exists():
        return False
    template.parent.mkdir(parents=True, exist_ok=True)
    with open(template.parent / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another start writes it now
            return False
        if template.exists():
            return False
        tmp = template.with_name(f".{template.name}.{os.getpid()}.tmp")
        src, dst = sqlite3.connect(source), sqlite3.connect(tmp)
        try:
            src.backup(dst)
            # one self-contained file (the server's database is in WAL mode): a copy of the
            # file alone is then the whole database
            dst.execute("PRAGMA journal_mode=DELETE")
        finally:
            dst.close()
            src.close()
        os.replace(tmp, template)
    return True
