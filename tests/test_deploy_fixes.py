"""`rlake deploy` / `rlake serve` fixes (review, 2026-11-29): local paths recorded absolute, one
serve per home, intervals checked and bad specs reported without stopping serve, serve's Prefect
server dying with it, racing ticks of one run, complete runs' deployments paused.

The serve tests share one `rlake serve` (module fixture, tests in file order: the last ones kill
it and start another)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from buffer import Lake
from flows import deployments
from infra.config import ConfigError, RunConfig
from infra.recovery import _HELD, claim_run, pid_alive, release_run, stop_processes
from tests.opshelp import ROOT, cli_env, pids_with_env, rlake, tail

# a hang guard per wait (fails with the logs), not a speed expectation
HANG_GUARD_S = 300


def _wait_for(log: Path, text: str, proc: subprocess.Popen | None = None,
              guard_s: float = HANG_GUARD_S) -> None:
    end = time.monotonic() + guard_s
    while text not in log.read_text():
        assert proc is None or proc.poll() is None, f"exited ({proc.returncode}): {tail(log)}"
        assert time.monotonic() < end, f"hang guard: no {text!r}: {tail(log)}"
        time.sleep(0.5)


def _holder(code: str, *args: str) -> tuple[subprocess.Popen, str]:
    """A Python process running ``code`` (argv: ``args``): (it, its first line)."""
    proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, env=cli_env(None))
    return proc, proc.stdout.readline().strip()


CLAIM = """import sys, time
from pathlib import Path
from infra.recovery import claim_run
try:
    claim_run(Path(sys.argv[1]))
except ValueError:
    print("refused", flush=True)
    sys.exit(3)
print("claimed", flush=True)
time.sleep(600)
"""


# -- 1. local paths recorded absolute -----------------------------------------------------------

def test_deploy_records_home_and_local_paths_absolute(tmp_path):
    """A relative home (the quickstart's ./rlake-home) was recorded as given, and serve, in
    another folder, made the run's lake, MLflow store and run folder there."""
    (tmp_path / "c.yaml").write_text("home: h1\nlake_uri: lk\ndata:\n  prompt_data: p.jsonl@[0:4]\n"
                                     "eval:\n  datasets:\n  - {name: ev, path: ev.jsonl}\n"
                                     "rollout:\n  custom_rm_path: tests.opshelp:length_reward\n")
    log = tmp_path / "deploy.log"
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, "-m", "infra.cli", "deploy", "c.yaml", "--name", "d1",
                               "--interval", "20", "--set", "model.path=m"], cwd=tmp_path,
                              env=cli_env(None, PYTHONPATH=str(ROOT), COLUMNS="500"), stdout=out,
                              stderr=subprocess.STDOUT, timeout=300)
    assert proc.returncode == 0, tail(log)
    spec = json.loads((tmp_path / "h1" / "deployments" / "d1.json").read_text())
    cfg = spec["config"]
    assert cfg["home"] == str(tmp_path / "h1")
    assert cfg["lake_uri"] == str(tmp_path / "lk")
    assert cfg["model"]["path"] == str(tmp_path / "m")
    assert cfg["data"]["prompt_data"] == f"{tmp_path / 'p.jsonl'}@[0:4]"
    assert cfg["eval"]["datasets"][0]["path"] == str(tmp_path / "ev.jsonl")
    assert cfg["rollout"]["custom_rm_path"] == "tests.opshelp:length_reward"  # a module path
    assert f"rlake serve --home {tmp_path / 'h1'}" in log.read_text()


def test_a_run_recorded_with_relative_paths_matches_its_absolute_deployment(tmp_path):
    """A run recorded before 2026-11-29 has its paths as given (`rlake run` records them
    absolute since: infra.startup.record_run): a deployment of that run (absolute paths) is the
    same config when the relative ones are read from where deploy ran."""
    recorded = RunConfig(home="h", model={"path": "m"}, data={"prompt_data": "p.jsonl"})
    row = {"config": recorded.model_dump_json(), "notes": "{}"}
    deployed = RunConfig.model_validate(deployments.absolute_paths(recorded.model_dump(), tmp_path))
    assert deployed.model.path == str(tmp_path / "m")
    deployments.check_recorded_config(deployed, "r", row, base=tmp_path)
    with pytest.raises(ConfigError, match="model.path"):
        deployments.check_recorded_config(deployed, "r", row, base=tmp_path / "elsewhere")


# -- 3. intervals -------------------------------------------------------------------------------

def test_save_spec_refuses_an_interval_serve_cannot_hold(tmp_path):
    for bad in (math.nan, math.inf, 1e20, 1e-9, 0.5, 0, -5, 367 * 86400):
        with pytest.raises(ValueError, match=r"^--interval must be from 1 to 31622400 seconds"):
            deployments.save_spec(tmp_path, "n", {}, "r", None, bad)
    assert not list(tmp_path.glob("deployments/*.json"))
    for good in (1, 366 * 86400):
        assert deployments.save_spec(tmp_path, "n", {}, "r", None, good).exists()


# -- 5. ticks racing at start-up ----------------------------------------------------------------

def test_a_tick_racing_another_for_the_run_folder_never_fails(tmp_path, monkeypatch):
    """Two ticks of one run: both found no owner (``run_owner``) before either claimed the run
    folder, and the second failed in rl_run's claim (ValueError, flow run Failed). Here the
    other tick claims at the worst moment seen: right after this tick's probe, or as its
    rl_run starts: one of the two drives the run, the other does nothing, neither fails."""
    cfg = RunConfig(home=str(tmp_path)).model_dump()
    run_dir = tmp_path / "runs" / "r"
    other: dict = {}

    def other_tick() -> None:
        if not other:
            other["proc"], other["said"] = _holder(CLAIM, str(run_dir))

    real_owner = deployments.run_owner

    def probe(folder):
        owner = real_owner(folder)
        other_tick()
        return owner

    def fake_rl_run(config, run_id, resume):  # what the real one does first: claim the folder
        other_tick()
        claim_run(run_dir)
        release_run(run_dir)
        return {"run_id": run_id, "status": "completed"}

    monkeypatch.setattr(deployments, "run_owner", probe)
    monkeypatch.setattr(deployments, "rl_run", fake_rl_run)
    try:
        result = deployments.scheduled_run.fn(cfg, "r")
    finally:
        if other:
            stop_processes([other["proc"].pid])
            other["proc"].wait()
    if other["said"] == "claimed":
        assert result["action"] == f"none (process {other['proc'].pid} runs it)", result
    else:
        assert (other["said"], result["action"]) == ("refused", "started"), (other, result)
    assert run_dir.resolve() not in _HELD  # released after rl_run returned


def test_a_tick_finding_the_run_owned_does_nothing_and_releases_nothing(tmp_path, monkeypatch):
    cfg = RunConfig(home=str(tmp_path)).model_dump()
    run_dir = tmp_path / "runs" / "r"
    holder, said = _holder(CLAIM, str(run_dir))
    monkeypatch.setattr(deployments, "rl_run", lambda *a, **k: pytest.fail("rl_run was called"))
    try:
        assert said == "claimed"
        result = deployments.scheduled_run.fn(cfg, "r")
        assert result == {"run_id": "r", "status": "running",
                          "action": f"none (process {holder.pid} runs it)"}
        assert deployments.run_owner(run_dir) == holder.pid  # still its
    finally:
        stop_processes([holder.pid])
        holder.wait()
    # a refused config releases the claim too
    Lake(str(tmp_path / "lake")).upsert_run({"run_id": "r", "status": "failed", "notes": "{}",
                                             "config": RunConfig(home=str(tmp_path), seed=3).model_dump_json()})
    with pytest.raises(ConfigError, match="seed: 3 -> 0"):
        deployments.scheduled_run.fn(cfg, "r")
    assert run_dir.resolve() not in _HELD


# -- 2. one serve per home (the lock) -----------------------------------------------------------

def test_serve_lock_is_exclusive_and_released_by_kill_9(tmp_path):
    from infra.prefect_server import lock_serve

    holder, said = _holder("import sys, time\nfrom infra.prefect_server import lock_serve\n"
                           "lock = lock_serve(sys.argv[1]); print('locked', flush=True); time.sleep(600)",
                           str(tmp_path))
    try:
        assert said == "locked"
        with pytest.raises(ValueError, match=rf"another `rlake serve` \(process {holder.pid}\) "
                                             "serves the home .*: one serve per home"):
            lock_serve(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    lock_serve(tmp_path).close()


# -- 4. the server and its starter --------------------------------------------------------------

def test_a_server_whose_starter_is_gone_is_adopted():
    from infra.prefect_server import starter_gone

    dead = subprocess.Popen(["true"])
    dead.wait()
    assert starter_gone({"pid": 1, "url": "u", "starter": dead.pid})
    assert starter_gone({"pid": 1, "url": "u"})  # recorded before servers had a starter
    assert not starter_gone({"pid": 1, "url": "u", "starter": os.getpid()})


# -- the serve tests: one `rlake serve` for the module ------------------------------------------

def _deployment_states(url: str) -> dict[str, dict]:
    """name -> {"paused", "scheduled": flow runs Scheduled} for every deployment on ``url``."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterId,
        FlowRunFilter,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.settings import PREFECT_API_URL, temporary_settings

    out = {}
    with temporary_settings({PREFECT_API_URL: url}), get_client(sync_client=True) as client:
        for dep in client.read_deployments():
            scheduled = client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id])),
                flow_run_filter=FlowRunFilter(state=dict(type=FlowRunFilterStateType(
                    any_=[StateType.SCHEDULED]))))
            out[dep.name] = {"paused": dep.paused, "scheduled": len(scheduled)}
    return out


def _start_serve(home: Path, log: Path, *args: str) -> subprocess.Popen:
    env = cli_env(None, PREFECT_HOME=str((home / "prefect").resolve()))
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "infra.cli", "serve", "--home", str(home),
                                 *args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _end(proc: subprocess.Popen, home: Path) -> list[int]:
    """Stop ``proc`` (SIGTERM) and whatever of the home is left; returns what was left."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    end = time.monotonic() + 10
    prefect_home = str((home / "prefect").resolve())
    while (left := pids_with_env("PREFECT_HOME", prefect_home)) and time.monotonic() < end:
        time.sleep(0.5)
    stop_processes(left)
    return left


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A serve of one deployment whose run the lake says is complete (a tick of it would do
    nothing), maintenance off: yields (home, serve process, its log)."""
    home = tmp_path_factory.mktemp("served")
    cfg = RunConfig(home=str(home))
    Lake(str(home / "lake")).upsert_run({"run_id": "done", "status": "completed", "notes": "{}",
                                         "config": cfg.model_dump_json()})
    deployments.save_spec(home, "done", cfg.model_dump(), "done", None, 2)
    log = home / "serve.log"
    serve = _start_serve(home, log, "--maintenance-interval", "0")
    state = {"serve": serve}
    try:
        _wait_for(log, "serving deployment 'done'", serve)
        yield home, state, log
    finally:
        _end(state["serve"], home)


def _url(home: Path) -> str:
    return json.loads((home / "prefect" / "server.json").read_text())["url"]


def test_serve_pauses_a_deployment_whose_run_is_complete(served):
    """Ticks after the run completed each started a flow-run process (~10-20 s here) that did
    nothing, forever, delaying the other deployments."""
    home, state, log = served
    _wait_for(log, "deployment 'done': run done is complete: paused (no more ticks)", state["serve"],
              guard_s=60)
    _assert_no_scheduled_runs_left(home)
    # Prefect's pause deletes the Scheduled runs, but its scheduler service may insert the ones
    # it planned before the pause just after (100 were left once on a loaded CI machine): runs
    # scheduled after the pause are deleted by serve
    _schedule_runs(_url(home), "done", 3)
    _assert_no_scheduled_runs_left(home)
    assert log.read_text().count("is complete: paused") == 1  # said once


def _assert_no_scheduled_runs_left(home: Path, guard_s: float = 60) -> None:
    deadline = time.monotonic() + guard_s
    while (states := _deployment_states(_url(home)))["done"]["scheduled"] and time.monotonic() < deadline:
        time.sleep(1)
    assert states["done"] == {"paused": True, "scheduled": 0}, states


def _schedule_runs(url: str, deployment: str, n: int) -> None:
    """``n`` flow runs of ``deployment`` Scheduled an hour from now (as Prefect's scheduler makes)."""
    from datetime import UTC, datetime, timedelta

    from prefect import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Scheduled

    with temporary_settings({PREFECT_API_URL: url}), get_client(sync_client=True) as client:
        dep = next(d for d in client.read_deployments() if d.name == deployment)
        for _ in range(n):
            client.create_flow_run_from_deployment(
                dep.id, state=Scheduled(scheduled_time=datetime.now(UTC) + timedelta(hours=1)))


def test_a_second_serve_on_the_home_is_refused(served, tmp_path):
    """It said "already running", shared the server, and when stopped paused every deployment
    (Prefect's Runner does on stop): the first serve fired nothing after, silently. Refused
    now, before it touches the server."""
    home, state, log = served
    second = rlake(["serve", "--home", str(home), "--maintenance-interval", "0"],
                   cli_env(None), tmp_path / "second.log", timeout=120)
    out = (tmp_path / "second.log").read_text()
    assert second.returncode == 1, out
    assert f"error: another `rlake serve` (process {state['serve'].pid}) serves the home " \
           f"{home.resolve()}: one serve per home (stop that one first)" in out, out
    assert "Prefect server" not in out and len(out.strip().splitlines()) == 1, out
    assert state["serve"].poll() is None


BAD_SPECS = {"nan.json": '{"name": "nan", "config": {}, "run_id": "nan", "cron": null, "interval": NaN}',
             "huge.json": '{"name": "huge", "config": {}, "run_id": "huge", "cron": null, "interval": 1e20}',
             "inf.json": '{"name": "inf", "config": {}, "run_id": "inf", "cron": null, "interval": Infinity}',
             "garbage.json": '{"name": ',
             "list.json": "[1, 2]"}


def test_bad_specs_written_while_serving_are_reported_and_serving_goes_on(served):
    """A spec of interval inf or 1e20 written while serve ran killed it (its rescan raised
    OverflowError); NaN failed its start. Each is reported once with its path."""
    home, state, log = served
    for name, text in BAD_SPECS.items():
        (home / "deployments" / name).write_text(text)
    for name in BAD_SPECS:
        _wait_for(log, f"deployments: {home.resolve() / 'deployments' / name}: not served: ",
                  state["serve"], guard_s=60)
    # a whole rescan after the reports (a sleep of one rescan interval was not one on a slow
    # machine): a spec recorded now is served, and its complete run's deployment paused, by one
    deployments.save_spec(home, "later", RunConfig(home=str(home)).model_dump(), "done", None, 2)
    _wait_for(log, "deployment 'later': run done is complete: paused", state["serve"], guard_s=60)
    assert state["serve"].poll() is None, tail(log)
    text = log.read_text()
    assert "--interval must be from 1 to 31622400 seconds (366 days), got nan" in text
    assert sum(text.count(f"/{name}: not served") for name in BAD_SPECS) == len(BAD_SPECS), text
    assert "Traceback" not in text, text


def test_kill_9_of_serve_ends_its_server_and_a_new_serve_starts_with_bad_specs(served, tmp_path):
    """After a kill -9 of serve, the Prefect server it started ran forever (adopted by every
    later serve, never stopped). And a serve starting with bad specs recorded serves the
    others."""
    home, state, log = served
    server_pid = json.loads((home / "prefect" / "server.json").read_text())["pid"]
    assert pid_alive(server_pid)
    state["serve"].kill()
    state["serve"].wait()
    end = time.monotonic() + 60
    while pid_alive(server_pid) and time.monotonic() < end:
        time.sleep(0.5)
    assert not pid_alive(server_pid), "the Prefect server outlived `rlake serve` (kill -9)"
    # the serve lock went with the process: a new serve starts, bad specs recorded
    log2 = tmp_path / "serve2.log"
    state["serve"] = _start_serve(home, log2, "--maintenance-interval", "0")
    _wait_for(log2, "deployment 'done': run done is complete: paused", state["serve"])
    text = log2.read_text()
    assert "(started)" in text and "serving deployment 'done'" in text, text
    assert all(f"/{name}: not served" in text for name in BAD_SPECS), text
    server_pid = json.loads((home / "prefect" / "server.json").read_text())["pid"]
    left = _end(state["serve"], home)
    assert state["serve"].returncode == 0, tail(log2)
    assert "Prefect server stopped" in log2.read_text()
    assert not pid_alive(server_pid) and left == [], left
