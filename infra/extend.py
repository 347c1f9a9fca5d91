"""A run's length changed when it is resumed: ``rlake resume RUN_ID --num-rollout N``.

A run's settings are fixed at its record (a resume reads its config from the lake's ``runs``
row), except the number of RL iterations: a slime user relaunches with a larger
``--num-rollout`` to train a finished run further, or a smaller one to stop an unfinished run
early. The new value is written into the recorded config before the resume opens the run, so
this resume and every later one go to N; the row's notes keep each change
(``num_rollout_changes``: from, to, at). Nothing else of the run changes: the iterations it
committed stay as they are, and the data position, weights and lake continue from them.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

from infra.config import RunConfig, config_from_dict


class LengthError(ValueError):
    """``--num-rollout`` refused (one line: what was asked and what is allowed)."""


def committed_iterations(lake, run_id: str) -> int:
    """How many iterations the run has committed: max(train_steps.iteration) + 1, 0 if none."""
    steps = lake.read("train_steps", run_id=run_id, columns=["iteration"])
    iterations = steps.column("iteration").to_pylist() if steps.num_rows else []
    return max(iterations) + 1 if iterations else 0


def set_num_rollout(lake, run_id: str, row: dict, num_rollout: int) -> RunConfig:
    """Record ``num_rollout`` as run ``run_id``'s (``row``: its runs row) and return the recorded
    config with it. Refused below the iterations the run has committed (they cannot be taken
    back), and for a replay (it trains its source's recorded iterations). Asking for the value
    already recorded writes nothing."""
    if row.get("replay_of"):
        raise LengthError(f"--num-rollout: run '{run_id}' is a replay of '{row['replay_of']}', "
                          "which trains its source's recorded iterations (`rlake replay "
                          "--iterations` chooses them)")
    recorded = config_from_dict(json.loads(row["config"]))
    done = committed_iterations(lake, run_id)
    if num_rollout < max(done, 1):
        has = (f"has committed {done} iteration{'s' * (done != 1)} (0..{done - 1})" if done
               else "needs at least one iteration")
        raise LengthError(f"--num-rollout {num_rollout}: run '{run_id}' {has}; give "
                          f"{max(done, 1)} or more (it has num_rollout={recorded.num_rollout})")
    if num_rollout == recorded.num_rollout:
        return recorded
    # the recorded JSON with the one key changed (not re-dumped: keys recorded stay as they were)
    config = json.loads(row["config"])
    config["num_rollout"] = num_rollout
    notes = json.loads(row.get("notes") or "{}")
    notes.setdefault("num_rollout_changes", []).append(
        {"from": recorded.num_rollout, "to": num_rollout, "at": datetime.now(UTC).isoformat()})
    # one commit: the config, its history and a finished run's status (with iterations left it is
    # not complete: a deployment's tick would leave a "completed" run alone) change together
    reopened = num_rollout > done and row.get("status") == "completed"
    lake.upsert_run({"run_id": run_id, "config": json.dumps(config), "notes": json.dumps(notes),
                     **({"status": "running"} if reopened else {})})
    return config_from_dict(config)
