"""`rlake serve` + `rlake deploy`: a deployment recorded while serve runs, on a short interval,
produces a completed flow run (and so does the built-in lake-maintenance deployment); then
everything started is stopped."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import yaml

from buffer import Lake
from infra.recovery import pid_alive, stop_processes
from tests.opshelp import ROOT, TINY, cli_env, paused_deployments, pids_with_env, rlake, tail

# a hang guard per wait (fails with the logs), not a speed expectation: each wait ends on an
# event (a log line, a completed flow run) or on the serve process dying
HANG_GUARD_S = 900


def _completed_by_deployment(url: str) -> dict[str, list[str]]:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterStateType
    from prefect.client.schemas.objects import StateType
    from prefect.settings import PREFECT_API_URL, temporary_settings

    out: dict[str, list[str]] = {}
    # only finished runs: an interval schedule creates ~100 future runs per deployment, which
    # would push the completed ones off the API's first page
    done = FlowRunFilter(state=dict(type=FlowRunFilterStateType(any_=[StateType.COMPLETED])))
    # settings, not os.environ: Prefect may already be imported (its settings read at import)
    with temporary_settings({PREFECT_API_URL: url}), get_client(sync_client=True) as client:
        names = {d.id: d.name for d in client.read_deployments()}
        for fr in client.read_flow_runs(flow_run_filter=done):
            if fr.deployment_id in names:
                out.setdefault(names[fr.deployment_id], []).append(fr.state_type.value)
    return out


def test_serve_then_deploy_interval_runs_it_and_stops_cleanly(tmp_path):
    home = tmp_path / "home"
    overrides = dict(item.split("=", 1) for item in TINY[1::2])
    cfg = {"home": str(home), "num_rollout": 2, "eval": {"eval_interval": 2}}
    for key, value in overrides.items():
        node = cfg
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(cfg))
    bad = rlake(["deploy", str(tmp_path / "tiny.yaml"), "--name", "x"], cli_env(None), tmp_path / "bad.log")
    assert bad.returncode == 1 and "exactly one of --cron" in (tmp_path / "bad.log").read_text()

    # serve first (maintenance only), deploy while it serves: the running serve picks it up
    prefect_home = str((home / "prefect").resolve())
    serve_log = open(tmp_path / "serve.log", "w")
    serve = subprocess.Popen([sys.executable, "-m", "infra.cli", "serve", "--home", str(home),
                              "--maintenance-interval", "20"], cwd=ROOT,
                             env=cli_env(None, PREFECT_HOME=prefect_home), stdout=serve_log,
                             stderr=subprocess.STDOUT, start_new_session=True)
    try:
        guard = time.monotonic() + HANG_GUARD_S
        while "serving deployment 'lake-maintenance'" not in (tmp_path / "serve.log").read_text():
            assert serve.poll() is None, f"serve exited ({serve.returncode}): {tail(tmp_path / 'serve.log')}"
            assert time.monotonic() < guard, f"hang guard: serve never served: {tail(tmp_path / 'serve.log')}"
            time.sleep(1)
        log = tmp_path / "deploy.log"
        proc = rlake(["deploy", str(tmp_path / "tiny.yaml"), "--name", "tiny", "--interval", "20"],
                     cli_env(None), log)
        assert proc.returncode == 0, tail(log)
        spec = json.loads((home / "deployments" / "tiny.json").read_text())
        assert (spec["run_id"], spec["interval"]) == ("tiny", 20.0)
        states: dict[str, list[str]] = {}
        guard = time.monotonic() + HANG_GUARD_S
        while not all("COMPLETED" in states.get(n, []) for n in ("tiny", "lake-maintenance")):
            assert serve.poll() is None, f"serve exited ({serve.returncode}): {tail(tmp_path / 'serve.log')}"
            assert time.monotonic() < guard, f"hang guard: {states}: {tail(tmp_path / 'serve.log')}"
            time.sleep(3)
            info = home / "prefect" / "server.json"
            if info.exists():
                states = _completed_by_deployment(json.loads(info.read_text())["url"])
        assert "COMPLETED" in states.get("tiny", []), (states, tail(tmp_path / "serve.log"))
        assert "COMPLETED" in states.get("lake-maintenance", []), states
        run = Lake(str(home / "lake")).get_run("tiny")
        assert run["status"] == "completed"
        server_pid = json.loads((home / "prefect" / "server.json").read_text())["pid"]
        assert pid_alive(server_pid)
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(timeout=90)
        finally:
            # a process that ends with its parent (the MLflow helper of a run serve was
            # running) may take a moment after serve's exit
            end = time.monotonic() + 10
            while (leftovers := pids_with_env("PREFECT_HOME", prefect_home)) and time.monotonic() < end:
                time.sleep(0.5)
            stop_processes(leftovers + ([serve.pid] if serve.poll() is None else []))
            serve_log.close()
    # SIGTERM is serve's normal stop: it stops the server it started and exits 0
    assert serve.returncode == 0, tail(tmp_path / "serve.log")
    text = (tmp_path / "serve.log").read_text()
    assert "Prefect server stopped" in text, tail(tmp_path / "serve.log")
    assert "Traceback" not in text and "error:" not in text, tail(tmp_path / "serve.log")
    # Prefect's runner paused what it served as it stopped: no tick comes due with nobody serving
    assert paused_deployments(prefect_home) == {"lake-maintenance": True, "tiny": True}
    assert not pid_alive(server_pid), "the Prefect server outlived `rlake serve`"
    assert leftovers == [], f"processes left running: {leftovers}"


def test_deploy_refuses_a_run_id_outside_the_home(tmp_path):
    """``--run-id '../../x y'`` was recorded, and serve's first tick made the run's folder outside
    the home (review, 2026-11-29): refused by ``rlake deploy``, and again by the flow (a spec
    recorded before the check)."""
    import pytest

    from flows.deployments import scheduled_run
    from infra.config import RunConfig
    from tests.conftest import run_cli

    for bad in ("../../x y", ""):
        res = run_cli(["deploy", "configs/quickstart.yaml", "--name", "dep1", "--interval", "20",
                       "--set", f"home={tmp_path}", "--run-id", bad], check=False, timeout=300)
        assert res.returncode == 1 and f"--run-id: run id '{bad}' is not allowed" in res.stderr, res.stderr
    assert not (tmp_path / "deployments").exists()
    with pytest.raises(ValueError, match="run id '../../x y' is not allowed"):
        scheduled_run.fn(RunConfig(home=str(tmp_path)).model_dump(), "../../x y")
    assert not (tmp_path / "runs").exists() and not (tmp_path.parent / "x y").exists()
