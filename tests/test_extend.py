"""``rlake resume RUN --num-rollout N``: the rules of a run's changed length (infra/extend.py),
on a real lake. The end-to-end check (a finished run extended ends bitwise equal to one run of
that length) is in test_checkpoints.py."""

from __future__ import annotations

import json

import pytest

from buffer import Lake
from flows.deployments import check_recorded_config
from infra.config import ConfigError, RunConfig
from infra.extend import LengthError, committed_iterations, set_num_rollout


def _lake_with_run(tmp_path, committed: int, status: str = "completed", **row) -> Lake:
    lake = Lake(str(tmp_path / "lake"))
    cfg = RunConfig(home=str(tmp_path), num_rollout=4)
    lake.upsert_run({"run_id": "r", "status": status, "config": cfg.model_dump_json(),
                     "notes": json.dumps({"pid": 1}), **row})
    for i in range(committed):
        lake.append_train_step({"run_id": "r", "step": i, "iteration": i, "base_version": i,
                                "weight_version": i + 1})
    return lake


def _recorded(lake: Lake) -> tuple[int, str, dict]:
    row = lake.get_run("r")
    return json.loads(row["config"])["num_rollout"], row["status"], json.loads(row["notes"])


def test_a_longer_run_is_recorded_with_its_history_and_reopened(tmp_path):
    lake = _lake_with_run(tmp_path, committed=4)
    assert committed_iterations(lake, "r") == 4
    cfg = set_num_rollout(lake, "r", lake.get_run("r"), 6)
    assert cfg.num_rollout == 6
    num_rollout, status, notes = _recorded(lake)
    # "completed" no more: iterations are left (a deployment's tick leaves a completed run alone)
    assert (num_rollout, status, notes["pid"]) == (6, "running", 1)
    assert [(c["from"], c["to"]) for c in notes["num_rollout_changes"]] == [(4, 6)]
    set_num_rollout(lake, "r", lake.get_run("r"), 9)
    assert [(c["from"], c["to"]) for c in _recorded(lake)[2]["num_rollout_changes"]] == [(4, 6), (6, 9)]


def test_an_unfinished_run_may_stop_at_what_it_committed_not_below(tmp_path):
    lake = _lake_with_run(tmp_path, committed=2, status="running")
    with pytest.raises(LengthError, match=r"--num-rollout 1: run 'r' has committed 2 iterations "
                                          r"\(0\.\.1\); give 2 or more \(it has num_rollout=4\)"):
        set_num_rollout(lake, "r", lake.get_run("r"), 1)
    assert _recorded(lake)[0] == 4 and "num_rollout_changes" not in _recorded(lake)[2]
    set_num_rollout(lake, "r", lake.get_run("r"), 2)
    assert _recorded(lake)[:2] == (2, "running")


def test_a_run_with_nothing_committed_needs_one_iteration(tmp_path):
    lake = _lake_with_run(tmp_path, committed=0, status="failed")
    with pytest.raises(LengthError, match="--num-rollout 0: run 'r' needs at least one iteration; give 1"):
        set_num_rollout(lake, "r", lake.get_run("r"), 0)
    set_num_rollout(lake, "r", lake.get_run("r"), 3)
    assert _recorded(lake)[:2] == (3, "failed")  # only a completed run is reopened


def test_the_recorded_length_again_writes_nothing(tmp_path):
    lake = _lake_with_run(tmp_path, committed=4)
    version = lake.table_version("runs")
    assert set_num_rollout(lake, "r", lake.get_run("r"), 4).num_rollout == 4
    assert lake.table_version("runs") == version


def test_a_replay_keeps_its_sources_length(tmp_path):
    lake = _lake_with_run(tmp_path, committed=1, replay_of="src")
    with pytest.raises(LengthError, match="run 'r' is a replay of 'src'"):
        set_num_rollout(lake, "r", lake.get_run("r"), 8)
    assert _recorded(lake)[0] == 4


def test_a_deployment_continues_a_run_whose_length_a_resume_changed(tmp_path):
    """The deployment's spec keeps the length it was deployed with; the run's changed one wins
    (any other difference is still refused)."""
    lake = _lake_with_run(tmp_path, committed=4)
    deployed = RunConfig(home=str(tmp_path), num_rollout=4)
    set_num_rollout(lake, "r", lake.get_run("r"), 6)
    check_recorded_config(deployed, "r", lake.get_run("r"))
    with pytest.raises(ConfigError, match=r"trainer.lr: 0.001 -> 0.0003"):
        check_recorded_config(deployed.model_copy(update={"trainer": deployed.trainer.model_copy(
            update={"lr": 0.0003})}), "r", lake.get_run("r"))
    untouched = _lake_with_run(tmp_path / "b", committed=4)
    with pytest.raises(ConfigError, match=r"num_rollout: 4 -> 5"):
        check_recorded_config(RunConfig(home=str(tmp_path), num_rollout=5), "r", untouched.get_run("r"))
