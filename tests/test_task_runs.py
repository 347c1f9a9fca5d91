"""``prefect_task_runs: false``: an iteration is one Prefect flow run whose steps are plain calls
(tasks/step.py). The steps keep their retries and quoted parameters; a run trains to the same
weights, bit for bit, as with task runs; a kill -9 then `rlake resume` still finishes it; async
mode's rollout batches stay task runs (issue 14 asks for them in Prefect)."""

from __future__ import annotations

import json
import signal
import sqlite3
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from prefect.utilities.annotations import quote
from safetensors.torch import load_file

from infra.recovery import run_tag
from tasks.step import StepTask
from tests.opshelp import TINY, cli_env, read_until, rlake, shared_prefect_server, tail

N_ITER = 3


def _rt(task_runs: bool) -> SimpleNamespace:
    return SimpleNamespace(cfg=SimpleNamespace(prefect_task_runs=task_runs))


def test_a_plain_step_unquotes_retries_and_raises_its_last_error():
    calls = []

    def flaky(rt, rows, *, fail_times):
        calls.append(rows)
        if len(calls) <= fail_times:
            raise OSError(f"busy {len(calls)}")
        return len(rows)

    step = StepTask(flaky, "flaky", retries=2, retry_delay_seconds=0)
    assert step(_rt(False), quote([1, 2, 3]), fail_times=2) == 3
    assert calls == [[1, 2, 3]] * 3  # unquoted, as Prefect hands a task its parameters
    calls.clear()
    with pytest.raises(OSError, match="busy 3"):
        step(_rt(False), [1], fail_times=5)
    assert len(calls) == 3  # the first call and two retries
    calls.clear()
    assert step.submit(_rt(False), quote([4, 5]), fail_times=0).result() == 2
    with pytest.raises(OSError, match="busy"):
        step.submit(_rt(False), [1], fail_times=9).result()
    assert step.fn is flaky and step.__name__ == "flaky"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from shared_prefect_server(tmp_path_factory, "task-runs-server")


def _args(home: Path, run_id: str, *extra: str) -> list[str]:
    return ["run", "--set", f"home={home}", "--set", f"run_id={run_id}",
            "--set", f"num_rollout={N_ITER}", "--set", "eval.eval_interval=10",
            "--set", "deterministic=true", "--set", "rollout.custom_rm_path=tests.opshelp:length_reward",
            *TINY, *extra]


def _final_weights(home: Path, run_id: str) -> dict[str, torch.Tensor]:
    return load_file(home / "runs" / run_id / "checkpoints" / f"v{N_ITER:06d}" / "model.safetensors")


def _flow_runs(server_home: Path, run_id: str, settled=lambda runs: True
               ) -> list[tuple[str, str, int]]:
    """(flow name, state, task runs inside) of each flow run tagged with the rlake run, once
    ``settled(runs)`` (task runs are recorded from events, late) or two minutes passed."""
    return read_until(lambda: _read_flow_runs(server_home, run_id), settled)


def _read_flow_runs(server_home: Path, run_id: str) -> list[tuple[str, str, int]]:
    with sqlite3.connect(server_home / "prefect" / "prefect.db") as con:
        rows = con.execute(
            "SELECT f.name, fr.state_type, fr.tags, (SELECT count(*) FROM task_run t "
            "WHERE t.flow_run_id = fr.id) FROM flow_run fr JOIN flow f ON f.id = fr.flow_id"
        ).fetchall()
    return sorted((name, state, n) for name, state, tags, n in rows
                  if run_tag(run_id) in json.loads(tags))


def test_without_task_runs_the_same_weights_and_a_crash_resumes(server, tmp_path):
    server_home, url = server
    with_runs = tmp_path / "with"
    proc = rlake(_args(with_runs, "with"), cli_env(url), tmp_path / "with.log")
    assert proc.returncode == 0, tail(tmp_path / "with.log")

    plain = tmp_path / "plain"
    args = _args(plain, "plain", "--set", "prefect_task_runs=false")
    log = tmp_path / "crash.log"
    proc = rlake(args, cli_env(url, RLAKE_FAULT="during_train:1"), log)
    assert proc.returncode == -signal.SIGKILL, tail(log)
    log = tmp_path / "resume.log"
    proc = rlake(["resume", "plain", "--home", str(plain)], cli_env(url), log)
    assert proc.returncode == 0, tail(log)

    expected, got = _final_weights(with_runs, "with"), _final_weights(plain, "plain")
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected), "weights differ"
    iterations = [r for r in _flow_runs(server_home, "with", lambda runs: all(
        n >= 5 for name, _, n in runs if name == "rl_iteration")) if r[0] == "rl_iteration"]
    assert len(iterations) == N_ITER and all(n >= 5 for _, _, n in iterations), iterations
    plain_runs = _flow_runs(server_home, "plain")
    finished = [r for r in plain_runs if r[0] == "rl_iteration" and r[1] == "COMPLETED"]
    # iteration 1 crashed in its first process and completed in the resume
    assert len(finished) == N_ITER and all(n == 0 for _, _, n in finished), plain_runs
    # the killed process's runs were marked crashed on resume (its iteration run only when its
    # Running state had reached the server: without task runs nothing else says it started)
    crashed = [name for name, state, _ in plain_runs if state == "CRASHED"]
    assert "rl_run" in crashed and set(crashed) <= {"rl_run", "rl_iteration"}, plain_runs
    assert not [r for r in plain_runs if r[1] in ("RUNNING", "PENDING")], plain_runs


def test_async_without_task_runs_keeps_its_rollout_batches_in_prefect(server, tmp_path):
    server_home, url = server
    home = tmp_path / "home"
    args = _args(home, "plainasync", "--set", "prefect_task_runs=false", "--set", "mode=async",
                 "--set", "trainer.max_staleness=1")
    proc = rlake(args, cli_env(url), tmp_path / "async.log")
    assert proc.returncode == 0, tail(tmp_path / "async.log")
    runs = _flow_runs(server_home, "plainasync", lambda runs: any(
        name == "rollout_side" and n >= N_ITER for name, _, n in runs))
    iterations = [r for r in runs if r[0] == "rl_iteration"]
    assert len(iterations) == N_ITER and all(r[1:] == ("COMPLETED", 0) for r in iterations), runs
    [(_, state, batches)] = [r for r in runs if r[0] == "rollout_side"]
    assert state == "COMPLETED" and batches >= N_ITER, runs
    from buffer import Lake

    steps = Lake(str(home / "lake")).read("train_steps", run_id="plainasync").to_pylist()
    assert sorted(s["step"] for s in steps) == list(range(N_ITER))
    assert all(s["staleness_max"] <= 1 for s in steps)
