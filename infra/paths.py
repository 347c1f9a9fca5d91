"""A run's local paths made absolute: a config is recorded (``rlake run``'s row, ``rlake deploy``'s
spec) in one folder and read in another (a resume from elsewhere, ``rlake serve``'s folder); and
the ``--home``/``--lake`` options a printed command needs to find a run again."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_text_atomic(path: Path, text: str) -> None:
    """``path.write_text(text)`` whole or not at all: written under a temporary name beside it
    (``.NAME.PID.tmp``), then renamed over it in one step; its folder is made first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _absolute(path: str, base: Path) -> str:
    return str((base / os.path.expanduser(path)).resolve())


def _absolute_data_path(spec: str, base: Path) -> str:
    """``file.jsonl@[a:b]`` with the file's path made absolute (the row slice kept)."""
    path, at, rows = spec.rpartition("@[")
    if at and rows.endswith("]") and path:
        return f"{_absolute(path, base)}@[{rows}"
    return _absolute(spec, base)


def absolute_paths(config: dict, base: str | Path) -> dict:
    """``config`` (a RunConfig as a mapping) with its local paths absolute, relative ones taken
    from ``base``: home, a local lake_uri, model.path, trainer.ref_load, data.prompt_data, every
    eval dataset's path, rollout.sglang.log_dir, rollout.sglang.python when it names a file.
    Function paths (``module:function``) and remote URIs are kept. A deployment's run executes
    in ``rlake serve``'s folder: a relative home made the run's lake, MLflow store and run
    folder there; a run's recorded config read by a resume from another folder named files
    that were not there (review, 2026-11-29)."""
    base = Path(base)
    out = json.loads(json.dumps(config))  # a deep copy

    def fix(section: dict | None, key: str, convert=_absolute) -> None:
        if isinstance(section, dict) and isinstance(section.get(key), str) and section[key]:
            section[key] = convert(section[key], base)

    fix(out, "home")
    if isinstance(out.get("lake_uri"), str) and "://" not in out["lake_uri"]:
        fix(out, "lake_uri")
    fix(out.get("model"), "path")
    fix(out.get("trainer"), "ref_load")
    fix(out.get("data"), "prompt_data", _absolute_data_path)
    for dataset in (out.get("eval") or {}).get("datasets") or []:
        fix(dataset, "path", _absolute_data_path)
    sglang = (out.get("rollout") or {}).get("sglang")
    fix(sglang, "log_dir")
    if isinstance(sglang, dict) and "/" in str(sglang.get("python") or ""):
        fix(sglang, "python")
    return out


def place_options(home: str | Path, lake_uri: str | None, *, with_home: bool = True) -> list[str]:
    """``--home HOME`` (when ``with_home``) and ``--lake LAKE`` when the lake is not HOME/lake:
    the options a printed ``rlake resume``/``rlake run`` needs to find the run (a hint without
    ``--lake`` found no run: review, 2026-11-29)."""
    from buffer.uris import is_local, local_path

    options = ["--home", str(home)] if with_home else []
    if lake_uri and not (is_local(str(lake_uri))
                         and Path(local_path(str(lake_uri))).resolve() == (Path(home) / "lake").resolve()):
        options += ["--lake", str(lake_uri)]
    return options
