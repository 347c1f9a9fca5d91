"""Offline replay (with --rescore), lineage of a weight version, and the HTML/PNG report, on one
tiny source run made by the real CLI (one shared Prefect server for the CLI processes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from buffer import Lake
from infra.prefect_server import ensure_server, stop_server
from infra.report import write_report
from tests.opshelp import ROOT, TINY, cli_env, rlake, tail

SOURCE = "src"
ITERS = 3


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    home = tmp_path_factory.mktemp("ops-home")
    url = ensure_server(home)
    log = home / "source.log"
    proc = rlake(["run", "--set", f"home={home}", "--set", f"run_id={SOURCE}", "--set",
                  f"num_rollout={ITERS}", "--set", "eval.eval_interval=2", *TINY], cli_env(url), log)
    assert proc.returncode == 0, tail(log)
    yield home, url
    stop_server(home)



def test_replay_of_a_run_in_a_lake_outside_the_home(source, tmp_path):
    """A source whose lake is not HOME/lake (a shared lake) is replayed with --lake, and the
    replay lands beside it (it was "no run 'src' in the lake under HOME", whatever was set)."""
    home, url = source
    other = tmp_path / "other-home"
    log = tmp_path / "replay-lake.log"
    # given relative to the folder rlake runs in (the repository's root): recorded absolute
    relative = os.path.relpath(other, ROOT)
    args = ["replay", SOURCE, "--home", relative, "--iterations", "2:3", "--run-id", "rep-lake"]
    missing = rlake(args, cli_env(url), log)
    assert missing.returncode == 1 and "--lake" in log.read_text(), tail(log)
    proc = rlake([*args, "--lake", str(home / "lake")], cli_env(url), log)
    assert proc.returncode == 0, tail(log)
    run = Lake(str(home / "lake")).get_run("rep-lake")
    assert (run["replay_of"], run["status"]) == (SOURCE, "completed")
    assert not (other / "lake").exists()
    assert json.loads(run["config"])["home"] == str(other.resolve())  # was the relative path

def test_replay_rescore(source):
    home, url = source
    log = home / "replay.log"
    proc = rlake(["replay", SOURCE, "--home", str(home), "--iterations", "1:3", "--run-id", "rep",
                  "--rescore", "tests.opshelp:length_reward", "--set", "trainer.use_tis=true"],
                 cli_env(url), log)
    assert proc.returncode == 0, tail(log)
    lake = Lake(str(home / "lake"))
    run = lake.get_run("rep")
    assert (run["replay_of"], run["parent_run_id"], run["status"]) == (SOURCE, SOURCE, "completed")
    src = {r["sample_uid"]: r for r in lake.read("trajectories", run_id=SOURCE).to_pylist()}
    rep = [r for r in lake.read("trajectories", run_id="rep").to_pylist() if r["kind"] == "train"]
    assert len(rep) == 2 * 16
    for r in rep:  # the recorded responses, not new ones; rewards from the other function
        s = src[json.loads(r["metadata"])["source_sample_uid"]]
        assert s["iteration"] in (1, 2) and s["iteration"] - 1 == r["iteration"]
        assert r["response_token_ids"] == s["response_token_ids"]
        assert r["rollout_logprobs"] == s["rollout_logprobs"]
        assert r["weight_version"] == s["weight_version"]  # the version that generated it
        assert r["reward"] == pytest.approx(len(r["response"]) / 10)
    steps = sorted(lake.read("train_steps", run_id="rep").to_pylist(), key=lambda s: s["step"])
    assert [(s["step"], s["n_samples"]) for s in steps] == [(0, 16), (1, 16)]
    compared = lake.sql(
        "SELECT count(*) AS n, sum(CASE WHEN r.reward <> s.reward THEN 1 ELSE 0 END) AS changed "
        "FROM trajectories r JOIN trajectories s "
        "ON json_extract_string(r.metadata, '$.source_sample_uid') = s.sample_uid "
        "WHERE r.run_id = 'rep' AND r.kind = 'train'").to_pylist()[0]
    assert compared["n"] == 32 and compared["changed"] > 0

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{home}/mlflow/mlflow.db")
    mrun = client.get_run(run["mlflow_run_id"])
    assert mrun.data.tags["rlake.replay_of"] == SOURCE and mrun.info.status == "FINISHED"

    # each replayed iteration is a flow run named by its parameters; its samples (in the lake)
    # are not parameters (they were: ~190 KB per flow run in Prefect's database)
    assert [(r["parameters"], r["state"]) for r in _iteration_runs(url, "rep")] == [
        ({"run_id": "rep", "iteration": j, "source_iteration": j + 1}, "COMPLETED") for j in (0, 1)]
    text = log.read_text()  # the live display's lines
    assert "eval after 0 iterations: held-out accuracy" in text and "eval after 2 iterations" in text
    status = home / "status-rep.log"
    assert rlake(["status", "rep", "--home", str(home)], cli_env(None), status).returncode == 0
    assert (f"replay of {SOURCE} (iterations 1:3, rescored with tests.opshelp:length_reward)"
            in status.read_text()), tail(status)


def _flow_runs(api_url: str, run_id: str) -> list[dict]:
    """The flow runs tagged with ``run_id``: flow name, parameters, state type."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from infra.recovery import run_tag

    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            tags=FlowRunFilterTags(all_=[run_tag(run_id)])))
        names = {fid: client.read_flow(fid).name for fid in {r.flow_id for r in runs}}
    return [{"flow": names[r.flow_id], "parameters": r.parameters, "state": r.state_type.value}
            for r in runs]


def _iteration_runs(api_url: str, run_id: str) -> list[dict]:
    """The ``replay_iteration`` flow runs tagged with ``run_id``, by iteration."""
    found = [r for r in _flow_runs(api_url, run_id) if r["flow"] == "replay_iteration"]
    return sorted(found, key=lambda r: r["parameters"].get("iteration", -1))


def test_a_replay_under_an_existing_run_id_is_refused_and_the_run_kept(source):
    home, url = source
    lake = Lake(str(home / "lake"))
    before = lake.get_run(SOURCE)
    steps = lake.read("train_steps", run_id=SOURCE).num_rows
    log = home / "replay-same-id.log"
    proc = rlake(["replay", SOURCE, "--home", str(home), "--run-id", SOURCE, "--iterations", "0:2"],
                 cli_env(url), log)
    assert proc.returncode == 1, tail(log)
    assert f"run '{SOURCE}' already exists" in log.read_text()
    after = Lake(str(home / "lake")).get_run(SOURCE)  # was: status failed, replay_of itself
    assert (after["status"], after["replay_of"], after["updated_at"]) == (
        before["status"], before["replay_of"], before["updated_at"])
    assert lake.read("train_steps", run_id=SOURCE).num_rows == steps


# the CLI with an error injected into a replay once it has started (its row written): the
# iterations raise; with "unwritable", so does the write of the row's final status
FAILING_REPLAY = """
import sys
import buffer.lake
import flows.replay
from infra.cli import main

def fail(*args, **kwargs):
    raise RuntimeError("injected replay error")

flows.replay.replay_iterations = fail
if sys.argv[1] == "unwritable":
    upsert = buffer.lake.Lake.upsert_run
    def refuse_final(self, row):
        if row.get("status") not in (None, "running"):
            raise OSError("injected: the lake refused the row")
        return upsert(self, row)
    buffer.lake.Lake.upsert_run = refuse_final
del sys.argv[1]
main()
"""


@pytest.mark.parametrize("lake", ["writable", "unwritable"])
def test_a_replay_that_fails_closes_its_records_and_shows_its_error(source, lake):
    """A replay ending in an error marks its row failed and closes its MLflow run FAILED, through
    a run's own failure path (``flows.durability.fail_run``): each record is attempted even if
    the other cannot be written, and the error shown is the one that ended the replay (its own
    path wrote the row first, unguarded: a lake refusing it left the MLflow run open and showed
    the lake's error instead)."""
    from mlflow.tracking import MlflowClient

    home, url = source
    run_id, log = f"rep-fails-{lake}", home / f"replay-fails-{lake}.log"
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, "-c", FAILING_REPLAY, lake, "replay", SOURCE,
                               "--home", str(home), "--iterations", "0:2", "--run-id", run_id],
                              cwd=ROOT, env=cli_env(url), stdout=out, stderr=subprocess.STDOUT,
                              timeout=900)
    text = log.read_text()
    assert proc.returncode == 1 and "injected replay error" in text, tail(log)
    row = Lake(str(home / "lake")).get_run(run_id)
    assert row["replay_of"] == SOURCE
    assert row["status"] == ("failed" if lake == "writable" else "running")
    if lake == "unwritable":
        assert "could not mark the run failed in the lake" in text, tail(log)
    client = MlflowClient(f"sqlite:///{home}/mlflow/mlflow.db")
    assert client.get_run(row["mlflow_run_id"]).info.status == "FAILED"


def test_replay_killed_then_resumed_equals_an_uninterrupted_replay(source):
    home, url = source
    args = ["replay", SOURCE, "--home", str(home), "--iterations", "0:3", "--rescore",
            "tests.opshelp:length_reward", "--set", "deterministic=true"]
    crashed = rlake([*args, "--run-id", "rep-crash"],
                    cli_env(url, RLAKE_FAULT="after_checkpoint_save:1"), home / "rep-crash.log")
    assert crashed.returncode == -signal.SIGKILL, tail(home / "rep-crash.log")
    whole = rlake([*args, "--run-id", "rep-whole"], cli_env(url), home / "rep-whole.log")
    assert whole.returncode == 0, tail(home / "rep-whole.log")
    lake = Lake(str(home / "lake"))
    assert lake.get_run("rep-crash")["status"] == "running"  # killed: nobody marked it
    done = rlake(["resume", "rep-crash", "--home", str(home)], cli_env(url), home / "rep-resume.log")
    assert done.returncode == 0, tail(home / "rep-resume.log")
    assert "resuming replay rep-crash" in (home / "rep-resume.log").read_text()
    # in Prefect: the killed iteration Crashed, each iteration once Completed, and no run created
    # ahead of the kill left Pending
    states = sorted((r["flow"], r["parameters"].get("iteration"), r["state"])
                    for r in _flow_runs(url, "rep-crash"))
    assert [s for s in states if s[0] == "replay_iteration" and s[2] == "COMPLETED"] == [
        ("replay_iteration", i, "COMPLETED") for i in range(3)], states
    assert ("replay_iteration", 1, "CRASHED") in states, states
    assert not [s for s in states if s[2] in ("PENDING", "RUNNING", "SCHEDULED")], states

    run = lake.get_run("rep-crash")
    assert (run["replay_of"], run["status"]) == (SOURCE, "completed")
    steps = sorted(lake.read("train_steps", run_id="rep-crash").to_pylist(), key=lambda s: s["step"])
    assert [(s["step"], s["base_version"], s["weight_version"]) for s in steps] == [(i, i, i + 1) for i in range(3)]
    rows = [r for r in lake.read("trajectories", run_id="rep-crash").to_pylist() if r["kind"] == "train"]
    assert len(rows) == len({r["sample_uid"] for r in rows}) == 3 * 16
    assert all(r["reward"] == pytest.approx(len(r["response"]) / 10) for r in rows)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{home}/mlflow/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("rlake").experiment_id],
                              "tags.`rlake.run_id` = 'rep-crash'")
    assert [r.info.run_id for r in runs] == [run["mlflow_run_id"]] and runs[0].info.status == "FINISHED"
    versions = client.search_model_versions("name='rlake-rep-crash'")
    assert sorted(int(v.tags["weight_version"]) for v in versions) == [0, 1, 2, 3]

    ckpt = "runs/{}/checkpoints/v000003/model.safetensors"
    a, b = load_file(home / ckpt.format("rep-crash")), load_file(home / ckpt.format("rep-whole"))
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed replay differs from the uninterrupted one"


def test_lineage_names_iterations_samples_and_generating_version(source):
    home, _ = source
    log = home / "lineage.log"
    proc = rlake(["lineage", SOURCE, "--version", "2", "--home", str(home), "--json"], cli_env(None), log)
    assert proc.returncode == 0, tail(log)
    info = json.loads(log.read_text().strip().splitlines()[-1])
    lake = Lake(str(home / "lake"))
    step = [s for s in lake.read("train_steps", run_id=SOURCE).to_pylist() if s["weight_version"] == 2][0]
    assert [s["iteration"] for s in info["steps"]] == [1] == [step["iteration"]]
    assert sorted(s["sample_uid"] for s in info["samples"]) == sorted(step["sample_uids"])
    assert {s["iteration"] for s in info["samples"]} == {1}
    assert info["generated_by"] == {"1": 16}
    assert [a[:2] for a in info["ancestry"]] == [[1, 2], [0, 1]]
    text = home / "lineage.txt"
    rlake(["lineage", SOURCE, "--version", "2", "--home", str(home)], cli_env(None), text)
    assert "samples generated by: v1: 16" in text.read_text()
    bad = home / "bad.log"
    assert rlake(["lineage", SOURCE, "--version", "99", "--home", str(home)], cli_env(None), bad).returncode == 1
    assert "no train step producing weight version 99" in bad.read_text()


def test_report_html_and_figures(source, tmp_path):
    home, _ = source
    files = write_report(Lake(str(home / "lake")), SOURCE, tmp_path / "report.html")
    html = files[0].read_text()
    pngs = files[1:]
    assert {p.name for p in pngs} == {f"report-{n}.png" for n in
                                       ("reward", "kl_entropy", "length", "staleness", "time")}
    for p in pngs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
        assert f'src="{p.name}"' in html
    assert html.count("<tr>") == ITERS + 1  # header + one row per iteration
    assert "held_out/accuracy" in html
    # recorded (0.0) for every evaluation, drawn and listed only where some reward failed
    evals = Lake(str(home / "lake")).read("evals", run_id=SOURCE).to_pylist()
    assert {e["value"] for e in evals if e["metric"] == "failed_ratio"} == {0.0}
    assert "failed_ratio" not in html


def test_identical_eval_series_are_drawn_once():
    from infra.report import same_series

    groups = same_series({"held_out/accuracy": [(0, 0.5), (5, 0.7)], "held_out/pass@1": [(0, 0.5), (5, 0.7)],
                          "held_out/pass@4": [(0, 0.6), (5, 0.8)]})
    assert [names for _, names in groups] == [["held_out/accuracy", "held_out/pass@1"], ["held_out/pass@4"]]
    assert groups[1][0] == [(0, 0.6), (5, 0.8)]
