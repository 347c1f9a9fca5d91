"""The model registry past MLflow's 10,000-result search page: a long run's weight versions are
all found (a resume registers only what a crash missed), on a real MLflow SQLite store."""

from __future__ import annotations

import sqlite3

from infra.tracking import Tracker, tracking_db

VERSIONS = 10_050  # past one search page (MLflow returns at most 10,000 model versions)


def _copy_version(home, name: str, count: int) -> None:
    """``count`` more versions of model ``name`` shaped as its first (SQL: registering 10,000
    through MLflow takes minutes), tagged weight_version 1..count."""
    db = sqlite3.connect(tracking_db(home))
    cols = [r[1] for r in db.execute("PRAGMA table_info(model_versions)")]
    first = dict(zip(cols, db.execute("SELECT * FROM model_versions WHERE name=? AND version=1",
                                      (name,)).fetchone(), strict=True))
    tag_cols = [r[1] for r in db.execute("PRAGMA table_info(model_version_tags)")]
    tag = dict(zip(tag_cols, db.execute("SELECT * FROM model_version_tags WHERE name=? AND version=1 "
                                        "AND key='weight_version'", (name,)).fetchone(), strict=True))
    db.executemany(f"INSERT INTO model_versions ({','.join(cols)}) VALUES ({','.join('?' * len(cols))})",
                   ([{**first, "version": v + 1}[c] for c in cols] for v in range(1, count + 1)))
    db.executemany(f"INSERT INTO model_version_tags ({','.join(tag_cols)}) VALUES "
                   f"({','.join('?' * len(tag_cols))})",
                   ([{**tag, "version": v + 1, "value": str(v)}[c] for c in tag_cols]
                    for v in range(1, count + 1)))
    db.commit()
    db.close()


def test_every_weight_version_is_found_past_one_search_page(tmp_path):
    tracker = Tracker(tmp_path)
    tracker.start("long", params={}, tags={"rlake.run_id": "long"})
    tracker.register_weight_version("long", 0, {"checkpoint": None})
    tracker.flush()
    _copy_version(tmp_path, tracker.model_name("long"), VERSIONS - 1)

    again = Tracker(tmp_path)  # a resume's tracker: it asks the registry what is there
    again.start("long", params={}, tags={"rlake.run_id": "long"})
    assert again.registered_weight_versions("long") == set(range(VERSIONS))
    # registering a version already there returns it, not a new one
    assert str(again.register_weight_version("long", 10_001, {"checkpoint": None})) == "10002"
    assert str(again.register_weight_version("long", VERSIONS, {"checkpoint": None})) == str(VERSIONS + 1)
