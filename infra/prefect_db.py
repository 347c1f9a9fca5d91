"""A ready Prefect server database, copied into a fresh home instead of built there.

On a fresh home Prefect's server creates its SQLite database, runs its migrations and registers
its block types before it answers: seconds of every first start. All of it depends only on the
installed Prefect, so the first server on a machine (per Prefect version) leaves a copy of its
database in the cache, and later fresh homes start from that copy with both steps off:

    seed_database(phome)   before the server starts: a fresh home gets the template (True)
    save_template(phome)   after a server built its database itself: keep it as the template

    {cache}/prefect-db/prefect-<version>[-prefect-ray-<version>].db

(``infra.db_template``: safe under concurrent starts; a new Prefect version has another file
name, so an old template is never used). Set ``RLAKE_PREFECT_DB_TEMPLATE=0`` to build every
database from scratch. Nothing here imports
Prefect (it runs before Prefect's settings are read).
"""

from __future__ import annotations

import os
from pathlib import Path

from infra import db_template

DB_NAME = "prefect.db"
# the server's start-up steps a template already holds the result of
FROM_TEMPLATE_ENV = {"PREFECT_API_DATABASE_MIGRATE_ON_START": "false",
                     "PREFECT_API_BLOCKS_REGISTER_ON_START": "false"}


def template_path() -> Path:
    """The template for the installed Prefect (and prefect-ray, which registers blocks too)."""
    return db_template.template_path("prefect-db", ("prefect", "prefect-ray"))


def enabled() -> bool:
    """Templates apply to the default database only (a configured one is the user's)."""
    return (os.environ.get("RLAKE_PREFECT_DB_TEMPLATE", "1") != "0"
            and not os.environ.get("PREFECT_API_DATABASE_CONNECTION_URL")
            and not os.environ.get("PREFECT_SERVER_DATABASE_CONNECTION_URL"))


def seed_database(phome: Path) -> bool:
    """Give a fresh Prefect home (no database yet) a copy of the template, if there is one;
    True when it did (the server then skips migrations and block registration:
    ``FROM_TEMPLATE_ENV``). The caller holds the home's start lock."""
    return enabled() and db_template.copy_in(template_path(), Path(phome) / DB_NAME)


def save_template(phome: Path) -> bool:
    """Keep the database a server just built in ``phome`` (migrated, blocks registered) as the
    template, unless one exists or another process is writing it; True when written."""
    source = Path(phome) / DB_NAME
    if not enabled() or not source.exists():
        return False
    return db_template.write_once(template_path(), db_template.backup_to(source), wait=False)
