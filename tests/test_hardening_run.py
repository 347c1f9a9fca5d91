"""Hostile input to `rlake run` (issue 16.8, 16.9) through the real CLI: each fails with one
`error:` line naming the file and line or the config key, non-zero, no traceback; a run whose
rewards all fail warns each iteration and stops. Plus the MLflow logging that moved off the
iteration's path (batched, on a background thread) losing nothing on a clean stop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.opshelp import ROOT, TINY, cli_env, paused_deployments, rlake, tail

NO_SFT = [*TINY, "--set", "sft.enabled=false", "--set", "eval.eval_interval=100"]


def _run(tmp_path: Path, name: str, *extra: str, timeout: float = 600) -> tuple[int, str, list[str]]:
    log = tmp_path / f"{name}.log"
    args = ["run", "--set", f"home={tmp_path / 'home'}", "--set", f"run_id={name}", *NO_SFT, *extra]
    proc = rlake(args, cli_env(None, COLUMNS="1000"), log, timeout=timeout)
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    return proc.returncode, text, [line for line in text.splitlines() if line.startswith("error:")]


def test_non_utf8_prompt_file_names_file_and_line(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_bytes(b'{"prompt": "1+1=", "label": "2"}\n{"prompt": "2+2\xff=", "label": "4"}\n')
    rc, _, errors = _run(tmp_path, "utf8", "--set", f"data.prompt_data={data}", timeout=300)
    assert rc == 1
    (line,) = errors
    assert f"{data}:line 2: not UTF-8 text (byte 0xff at column 16)" in line


def test_huge_prompt_is_an_error_not_a_hang(tmp_path):
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "1+1=", "label": "2"}, {"prompt": "9" * 10_000_000 + "+1=", "label": "0"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # the hang guard: before the fix SFT ran on the 10 MB prompt for minutes with no error
    rc, _, errors = _run(tmp_path, "huge", "--set", f"data.prompt_data={data}",
                         "--set", "sft.enabled=true", timeout=400)
    assert rc == 1
    (line,) = errors
    assert f"{data}:line 2: prompt has" in line and "data.max_prompt_tokens=58" in line


def test_max_prompt_tokens_is_configurable(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "12+34=", "label": "46"}) + "\n")
    rc, _, errors = _run(tmp_path, "short", "--set", f"data.prompt_data={data}",
                         "--set", "data.max_prompt_tokens=3", timeout=400)
    assert rc == 1
    assert f"{data}:line 1: prompt has 6 tokens, more than data.max_prompt_tokens=3" in errors[0]


def test_an_eval_prompt_longer_than_the_context_names_its_file_and_line(tmp_path):
    """Eval sets skipped the length check the training prompts get: a prompt over the model's
    context was generated truncated, scored 0, and the run exited 0 (review, 2026-11-29)."""
    evals = tmp_path / "evals.jsonl"
    evals.write_text("".join(json.dumps(r) + "\n" for r in (
        {"prompt": "1+1=", "label": "2"}, {"prompt": "1" * 100 + "+1=", "label": "0"})))
    rc, _, errors = _run(tmp_path, "evlong", "--set", f"eval.datasets=[{{name: long, path: {evals}}}]")
    assert rc == 1
    (line,) = errors
    assert f"{evals}:line 2: prompt has 103 tokens, more than data.max_prompt_tokens=58" in line


@pytest.mark.parametrize("uri, expected", [
    ("file", "lake_uri '{uri}': is a file, not a folder"),
    ("ftp://host/lake", "lake_uri 'ftp://host/lake': unknown scheme 'ftp://'"),
])
def test_bad_lake_uri_names_the_key(tmp_path, uri, expected):
    if uri == "file":
        uri = str(tmp_path / "a-file")
        Path(uri).write_text("not a lake")
    rc, _, errors = _run(tmp_path, "lake", "--set", f"lake_uri={uri}", timeout=300)
    assert rc == 1
    assert expected.format(uri=uri) in errors[0]
    assert not (tmp_path / "home" / "prefect" / "prefect.db").exists()


def test_disk_full_error_names_the_path():
    """ENOSPC from a real device (/dev/full), as the startup reports it."""
    from infra.startup import describe_os_error

    try:
        with open("/dev/full", "w") as fh:
            fh.write("x")
            fh.flush()
    except OSError as err:
        err.filename = err.filename or "/dev/full"
        assert describe_os_error(err) == "no space left on device (writing /dev/full)"
    else:
        pytest.fail("/dev/full accepted a write")


def test_run_whose_rewards_all_fail_warns_and_stops(tmp_path):
    rc, text, errors = _run(tmp_path, "nor", "--set", "num_rollout=6",
                            "--set", "rollout.custom_rm_path=tests.test_hardening_run:broken_reward",
                            "--set", "rollout.max_failed_reward_iterations=2")
    assert rc == 1, text[-3000:]
    warnings = [line for line in text.splitlines() if "the reward failed for every sample" in line
                and "warning" in line]
    assert len(warnings) == 2, text[-3000:]
    (line,) = errors
    assert "in 2 consecutive iterations" in line and "rollout.max_failed_reward_iterations=2" in line
    from buffer import Lake

    lake = Lake(str(tmp_path / "home" / "lake"))
    assert lake.get_run("nor")["status"] == "failed"
    assert sorted(s["iteration"] for s in lake.read("train_steps", run_id="nor").to_pylist()) == [0, 1]
    # the failure path closed the MLflow run and the flow run
    from tests.test_startup import _flow_run_states, _mlflow_runs

    assert [s for _, s in _mlflow_runs(tmp_path / "home", "nor")] == ["FAILED"]
    states = [s for _, s in _flow_run_states(tmp_path / "home")]
    assert "FAILED" in states and "RUNNING" not in states, states


def broken_reward(cfg, sample) -> float:  # noqa: ARG001 - custom_rm_path signature
    raise RuntimeError("reward service down")


def half_broken_reward(cfg, sample) -> float:  # noqa: ARG001 - custom_rm_path signature
    if sample.index % 2:
        raise ValueError("odd sample")
    return 1.0


def test_a_reward_failing_on_some_samples_is_shown_once_and_the_run_goes_on(tmp_path):
    """Nothing said so before (review, 2026-11-29): the failed half trained as reward 0."""
    rc, text, errors = _run(tmp_path, "half", "--set", "num_rollout=3",
                            "--set", "rollout.custom_rm_path=tests.test_hardening_run:half_broken_reward")
    assert rc == 0 and not errors, text[-3000:]
    warnings = [line for line in text.splitlines() if "the reward failed for 50% of the samples" in line]
    assert len(warnings) == 1, text[-3000:]
    assert "tests.test_hardening_run:half_broken_reward" in warnings[0]
    from buffer import Lake

    rows = Lake(str(tmp_path / "home" / "lake")).read("trajectories", run_id="half").to_pylist()
    failed = [r for r in rows if r["kind"] == "train" and r["status"] == "failed"]
    assert failed and all("odd sample" in r["reward_detail"] for r in failed)


def eval_broken_reward(cfg, sample) -> float:  # noqa: ARG001 - custom_rm_path signature
    if sample.metadata.get("eval_dataset"):
        raise ValueError("no labels for the eval set")
    return 1.0


def test_an_eval_set_whose_rewards_all_fail_records_no_score(tmp_path):
    """It was recorded as pass@1 / accuracy 0, mean reward 0, without a word (review,
    2026-11-29): read as "the model got every one wrong". Now: failed_ratio 1.0 alone, and a
    warning naming the set and the first error at each evaluation."""
    rc, text, errors = _run(tmp_path, "evfail", "--set", "num_rollout=2",
                            "--set", "rollout.custom_rm_path=tests.test_hardening_run:eval_broken_reward")
    assert rc == 0 and not errors, text[-3000:]
    warnings = [line for line in text.splitlines() if "the reward failed for 100% of eval set "
                "'held_out''s samples (ValueError: no labels for the eval set); no score is recorded" in line]
    assert "held-out accuracy none (its rewards failed)" in text
    from buffer import Lake

    evals = Lake(str(tmp_path / "home" / "lake")).read("evals", run_id="evfail").to_pylist()
    versions = {e["weight_version"] for e in evals}
    assert len(versions) >= 2 and len(warnings) == len(versions), text[-3000:]
    assert {(e["metric"], e["value"]) for e in evals} == {("failed_ratio", 1.0)}


@pytest.mark.parametrize("when", ["starting", "registering", "runner-entering"])
def test_serve_on_sigterm_exits_cleanly(tmp_path, when):
    """SIGTERM while the Prefect server starts (sent from here), or at an exact later moment
    (sent by the serve itself, tests/signal_at.py): while it registers the deployments, or
    half-way into Prefect's Runner start (CI, 2026-12-02: exit 1 with a cancel-scope
    RuntimeError). Exit 0, no traceback, no server left behind; a stop asked once the
    deployments are registered pauses them. Once it serves: tests/test_deploy.py."""
    from infra.recovery import pid_alive

    home = tmp_path / "home"
    log = tmp_path / "serve.log"
    cmd = ["-m", "infra.cli"] if when == "starting" else ["-m", "tests.signal_at", when]
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, *cmd, "serve", "--home", str(home)],
                                cwd=ROOT, env=cli_env(None), stdout=out, stderr=subprocess.STDOUT)
    try:
        if when == "starting":
            deadline = time.monotonic() + 300
            while not (home / "prefect" / "server.log").exists():
                assert proc.poll() is None, tail(log)
                assert time.monotonic() < deadline, f"serve did not get there: {tail(log)}"
                time.sleep(0.2)
            time.sleep(1)
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 0, tail(log)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text()
    assert "Traceback" not in text and "error:" not in text, tail(log)
    if when != "starting":
        assert f"signal_at: SIGTERM at {when}" in text, tail(log)
        assert paused_deployments(home / "prefect") == {"lake-maintenance": True}
    servers = [p for p in _server_pids(home) if pid_alive(p)]
    assert servers == [], f"server processes left: {servers}"


@pytest.mark.parametrize("exits, clean", [([SystemExit(0)], True), ([KeyboardInterrupt()], True),
                                          ([SystemExit(0), ValueError("x")], False),
                                          ([SystemExit(2)], False)])
def test_serve_stopped_inside_prefects_runner(tmp_path, monkeypatch, exits, clean):
    """A SIGTERM while Prefect's Runner starts reaches ``serve`` as SystemExit(0) wrapped in a
    task group's exception group (the Runner's own handler): a clean stop. Anything else in the
    group is still an error."""
    from flows import deployments

    async def stopped(*_args) -> None:
        raise BaseExceptionGroup("unhandled errors in a TaskGroup", exits)

    monkeypatch.setattr(deployments, "_serve", stopped)
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9")  # serve_forever sets both
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    previous = signal.getsignal(signal.SIGTERM)
    try:
        if clean:
            deployments.serve_forever(tmp_path, "http://127.0.0.1:9", maintenance_interval=60)
        else:
            with pytest.raises(BaseExceptionGroup):
                deployments.serve_forever(tmp_path, "http://127.0.0.1:9", maintenance_interval=60)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _server_pids(home: Path) -> list[int]:
    """`prefect server start` processes (and their uvicorn) of ``home``."""
    from tests.opshelp import pids_with_env

    return pids_with_env("PREFECT_HOME", str(home / "prefect"))


def test_tracker_batches_in_background_and_flushes(tmp_path):
    """Real MLflow SQLite: metrics of many steps queued without waiting, all there after
    ``finish``; a failing queued call is raised by the next flush, not lost."""
    from infra.tracking import Tracker

    tracker = Tracker(tmp_path)
    run_id = tracker.start("t", params={"a": "1"}, tags={"rlake.run_id": "t"})
    for step in range(50):
        tracker.log_metrics({"x": float(step), "y": 2.0 * step, "none": None}, step)
    tracker.defer(lambda: (_ for _ in ()).throw(ValueError("boom")))
    with pytest.raises(RuntimeError, match="MLflow logging failed: boom"):
        tracker.flush()
    tracker.log_metrics({"x": 50.0}, 50)
    tracker.finish("FINISHED")
    history = tracker.client.get_metric_history(run_id, "x")
    assert sorted((m.step, m.value) for m in history) == [(s, float(s)) for s in range(51)]
    assert len(tracker.client.get_metric_history(run_id, "y")) == 50
    assert tracker.client.get_run(run_id).info.status == "FINISHED"
    # a process killed before it recorded the MLflow run's id: the run is found by its tag
    again = Tracker(tmp_path)
    assert again.start("t", params={}, tags={"rlake.run_id": "t"}) == run_id


# enough that the run is still going when the signal comes: with 20 (0.16 s each) a CI run
# finished before it, its output's "eval after 1 iteration" seen late (2026-11-29)
CTRL_C_ITERATIONS = 80


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_ctrl_c_in_a_terminal_is_an_interrupt_and_resume_finishes(tmp_path, mode):
    """A terminal's Ctrl-C goes to the whole foreground process group: it stopped the embedded
    Prefect server too, and the run failed on that ("Connection refused", exit 1) instead of
    stopping as interrupted (review, 2026-11-29). In async mode it reaches the rollout side's
    process as well."""
    home, log = tmp_path / "home", tmp_path / "run.log"
    args = ["run", "--set", f"home={home}", "--set", "run_id=ctrlc", *NO_SFT,
            "--set", f"num_rollout={CTRL_C_ITERATIONS}", "--set", "eval.eval_interval=1", "--set", f"mode={mode}",
            "--set", f"trainer.max_staleness={int(mode == 'async')}"]
    with open(log, "w") as out:  # a session of its own: the group gets the signal, as from a tty
        proc = subprocess.Popen([sys.executable, "-m", "infra.cli", *args], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, env=cli_env(None, COLUMNS="200"),
                                start_new_session=True)
    deadline = time.monotonic() + 300
    while "eval after 1 iteration:" not in log.read_text() and proc.poll() is None:
        assert time.monotonic() < deadline, tail(log)
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=120) == 130, tail(log)
    text = log.read_text()
    assert f"interrupted: `rlake resume ctrlc --home {home}` continues" in text, tail(log)
    assert "error:" not in text, tail(log)
    assert "Traceback" not in text and "could not close the MLflow run" not in text
    from mlflow.tracking import MlflowClient

    from buffer import Lake

    lake = Lake(str(home / "lake"))
    # a stopped run is recorded as one (it said failed / FAILED before 2026-11-29)
    row = lake.get_run("ctrlc")
    assert row["status"] == "interrupted", row["status"]
    client = MlflowClient(f"sqlite:///{home}/mlflow/mlflow.db")
    assert client.get_run(row["mlflow_run_id"]).info.status == "KILLED"
    done = rlake(["resume", "ctrlc", "--home", str(home)], cli_env(None), tmp_path / "resume.log")
    assert done.returncode == 0, tail(tmp_path / "resume.log")
    assert lake.get_run("ctrlc")["status"] == "completed"
    steps = lake.sql("SELECT iteration, count(*) AS n FROM train_steps GROUP BY 1 ORDER BY 1")
    assert steps.column("iteration").to_pylist() == list(range(CTRL_C_ITERATIONS))
    assert set(steps.column("n").to_pylist()) == {1}
    (samples,) = lake.sql(
        "SELECT count(*) AS n, count(DISTINCT sample_uid) AS uids, count(DISTINCT iteration) AS "
        "batches FROM trajectories WHERE kind = 'train'").to_pylist()
    assert samples["n"] == samples["uids"] and samples["batches"] == CTRL_C_ITERATIONS, samples


def test_the_calculator_example_runs_as_its_config_says(tmp_path):
    """`rlake run examples/calculator_tool/config.yaml` (the console script, no PYTHONPATH) was
    "No module named 'examples'": a function path is now also looked up in the folder rlake runs
    in. Its custom generate function's samples carry the engine's weight version (they were all
    version 0, and the second iteration's slice was empty: review, 2026-11-29)."""
    script = Path(sys.executable).parent / "rlake"
    env = {k: v for k, v in cli_env(None, COLUMNS="200").items() if k != "PYTHONPATH"}
    log = tmp_path / "calc.log"
    with open(log, "w") as out:
        proc = subprocess.run([str(script), "run", "examples/calculator_tool/config.yaml",
                               "--set", f"home={tmp_path / 'home'}", "--run-id", "calc",
                               "--set", "num_rollout=2", "--set", "eval.eval_interval=100"],
                              cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=600)
    assert proc.returncode == 0, tail(log)
    from buffer import Lake

    rows = Lake(str(tmp_path / "home" / "lake")).read("trajectories", run_id="calc").to_pylist()
    versions = {(r["iteration"], r["weight_version"]) for r in rows if r["kind"] == "train"}
    assert versions == {(0, 0), (1, 1)}, versions


def test_a_run_stopped_by_a_signal_is_recorded_interrupted_an_error_failed():
    """Prefect raises SIGTERM of a flow-run process (`rlake serve` stopping its runs) as
    ``TerminationSignal``: such a run, as a Ctrl-C'd one, is interrupted, not failed."""
    from prefect.exceptions import TerminationSignal

    from flows.durability import stop_status

    assert stop_status(TerminationSignal(signal.SIGTERM)) == ("interrupted", "KILLED")
    assert stop_status(KeyboardInterrupt()) == ("interrupted", "KILLED")
    assert stop_status(RuntimeError("disk full")) == ("failed", "FAILED")
    assert stop_status(None) == ("failed", "FAILED")


def test_any_error_after_a_noted_ctrl_c_is_the_interrupts():
    """In async mode a Ctrl-C also ends the rollout process, and the training side may fail on
    that first ("the rollout process exited"): the run was recorded failed though the CLI exits
    130 (a CI run, 2026-11-29)."""
    import infra.interrupts
    from flows.durability import stop_status

    infra.interrupts._NOTED.set()  # as the CLI's handler does on a Ctrl-C
    try:
        assert stop_status(RuntimeError("the rollout process exited (code 1)")) == ("interrupted", "KILLED")
    finally:
        infra.interrupts._NOTED.clear()  # the flag is the process's: later tests in it must not see it
    assert stop_status(RuntimeError("the rollout process exited (code 1)")) == ("failed", "FAILED")
