"""kill -9 at every named fault point in turn, resume each time, and check what the lake, MLflow and
Prefect say afterwards; with ``deterministic: true`` the final weights must equal, bit for bit,
those of an uninterrupted run with the same seed.

One run crashes at point k during iteration k (k = 0..len(POINTS) - 1) and is resumed after each
crash; a reference run goes uninterrupted (concurrently). Both save a checkpoint every iteration
(``save_interval=1``, in the background) so that every checkpoint point is hit; resumes between
saves are tested in tests/test_checkpoints.py. The first process uses its own embedded server:
that server must die with it (no orphan left for resume to find). The resumes then run against
the home's own server, started once (its start dominates otherwise), as a running `rlake serve`
gives: a run on a home whose server runs uses it (infra.prefect_server.EmbeddedServer.start).
"""

from __future__ import annotations

import json
import os
import signal
import time
from unittest.mock import patch

import pytest
import torch
from safetensors.torch import load_file

from infra.faults import POINTS as ALL_POINTS
from infra.prefect_server import EmbeddedServer, ensure_server, stop_server
from infra.recovery import pid_alive, prefect_servers, run_tag
from tests.opshelp import TINY, cli_env, rlake, tail

# during_evaluation fires only at an iteration that evaluates: tests/test_eval_resume.py
POINTS = [p for p in ALL_POINTS if p != "during_evaluation"]
N_ITER = len(POINTS) + 1
EVAL_INTERVAL = len(POINTS)  # evals after the during_mlflow_log crash's iteration and the last
# crashes between the trajectories' commit and the train_steps row's: the next process trains
# on the recorded samples of that iteration (reuse) instead of generating them again
# (during_background_write kills right after the row's commit: nothing left to reuse)
REUSING = list(POINTS)[list(POINTS).index("after_lake_append"):list(POINTS).index("during_weight_handoff") + 1]
# the tiny model never gets an addition right: with a 0/1 reward every advantage would be 0 and
# the weights would move by weight decay alone, whatever the data; a length reward makes the
# final weights depend on every trajectory
LENGTH_REWARD = "tests.opshelp:length_reward"


def _args(home, run_id):
    return ["run", "--set", f"home={home}", "--set", f"run_id={run_id}", "--set", f"num_rollout={N_ITER}",
            "--set", f"eval.eval_interval={EVAL_INTERVAL}", "--set", "deterministic=true",
            "--set", "keep_checkpoints=1", "--set", "save_interval=1",
            "--set", f"rollout.custom_rm_path={LENGTH_REWARD}", *TINY]


def _lake_invariants(home, run_id):
    from buffer import Lake

    lake = Lake(str(home / "lake"))
    traj = lake.read("trajectories", run_id=run_id,
                     columns=["sample_uid", "iteration", "kind", "weight_version", "prompt",
                              "response_token_ids", "rollout_logprobs", "reward"]).to_pylist()
    uids = [r["sample_uid"] for r in traj]
    assert len(uids) == len(set(uids)), "duplicate sample_uid"
    train = [r for r in traj if r["kind"] == "train"]
    assert sorted({r["iteration"] for r in train}) == list(range(N_ITER))
    assert all(sum(r["iteration"] == i for r in train) == 16 for i in range(N_ITER))
    steps = sorted(lake.read("train_steps", run_id=run_id).to_pylist(), key=lambda r: r["step"])
    assert [s["step"] for s in steps] == list(range(N_ITER)), "train_steps not consecutive"
    assert [(s["base_version"], s["weight_version"]) for s in steps] == [(i, i + 1) for i in range(N_ITER)]
    # the prompt position: each iteration drew the next 4 prompts, resumed or not
    positions = [json.loads(s["metrics"]).get("rollout/data_position_end") for s in steps]
    assert positions == [4.0 * (i + 1) for i in range(N_ITER)], positions
    consumed = [u for s in steps for u in s["sample_uids"]]
    assert sorted(consumed) == sorted(r["sample_uid"] for r in train), "a sample trained twice or never"
    evals = {e["weight_version"] for e in lake.read("evals", run_id=run_id).to_pylist()}
    assert evals == {0, EVAL_INTERVAL, N_ITER}
    run = lake.get_run(run_id)
    assert run["status"] == "completed"
    return run, {(r["iteration"], r["sample_uid"].rsplit("/", 1)[1]): r for r in train}


def _mlflow_invariants(home, run_id, mlflow_run_id):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{home}/mlflow/mlflow.db")
    exp = client.get_experiment_by_name("rlake")
    runs = client.search_runs([exp.experiment_id], f"tags.`rlake.run_id` = '{run_id}'")
    assert [r.info.run_id for r in runs] == [mlflow_run_id], "one MLflow run, continued"
    assert runs[0].info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(mlflow_run_id, "weight_version")]
    assert sorted(steps) == list(range(N_ITER)), "every iteration logged exactly once"
    versions = client.search_model_versions(f"name='rlake-{run_id}'")
    registered = sorted(int(v.tags["weight_version"]) for v in versions)
    assert registered == list(range(N_ITER + 1)), "each weight version registered once"
    for v in versions:
        assert v.source.startswith(f"runs:/{mlflow_run_id}/checkpoints/")
        assert {"run", "iteration", "lake_version", "sample_count", "checkpoint"} <= set(v.tags)
    # the last crash (during_mlflow_log, iteration N-2) committed the step but lost its metrics
    # and model version: the final resume re-logged and registered exactly those
    resume_note = json.loads(runs[0].data.tags["rlake.last_resume"])
    assert list(POINTS)[-1] == "during_mlflow_log"
    assert (resume_note["relogged"], resume_note["registered"]) == ([N_ITER - 2], [N_ITER - 1])


def _prefect_invariants(api_url, run_id):
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.settings import PREFECT_API_URL, temporary_settings

    # settings, not os.environ: Prefect may already be imported (its settings read at import)
    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            tags=FlowRunFilterTags(all_=[run_tag(run_id)])))
    states = [(fr.name, fr.state_type.value) for fr in runs]
    assert not [s for s in states if s[1] in ("RUNNING", "PENDING")], states
    flows = {fr.flow_id for fr in runs}
    assert len(flows) >= 2
    crashed = [fr for fr in runs if fr.state_type.value == "CRASHED"]
    # each crash leaves the run flow and the iteration flow it was in
    assert len(crashed) == 2 * len(POINTS), states


@pytest.fixture
def home(tmp_path):
    """The crashing run's home; its own Prefect server, once started, stopped at the end."""
    home = tmp_path / "home"
    home.mkdir()
    yield home
    stop_server(home)


def test_kill9_at_every_point_then_resume(home, tmp_path):
    ref_home = tmp_path / "ref"  # its own lake, MLflow and embedded server: no write contention
    ref_home.mkdir()
    ref_log = ref_home / "cli.log"
    ref = rlake(_args(ref_home, "ref"), cli_env(None), ref_log, background=True)
    orphans = []
    for k, point in enumerate(POINTS):
        first = k == 0
        args = _args(home, "chain") if first else ["resume", "chain", "--home", str(home)]
        env = cli_env(None, RLAKE_FAULT=f"{point}:{k}", COLUMNS="200")
        log = home / f"crash-{k}.log"
        proc = rlake(args, env, log)
        assert proc.returncode == -signal.SIGKILL, f"{point}: {tail(log)}"
        if first:  # the embedded server of the dead process ends with it (PR_SET_PDEATHSIG)
            deadline = time.monotonic() + 30
            while prefect_servers(home / "prefect") and time.monotonic() < deadline:
                time.sleep(0.5)
            orphans = prefect_servers(home / "prefect")
            assert not orphans, "the killed process's embedded server outlived it"
            shown = rlake(["status", "chain", "--home", str(home)], cli_env(None), home / "status.log")
            assert shown.returncode == 0 and "status: interrupted" in tail(home / "status.log")
            url = ensure_server(home)  # the resumes find it running and use it
            with patch.dict(os.environ):  # what start() sets is undone on the way out
                os.environ.pop("PREFECT_API_URL", None)
                assert EmbeddedServer.start(home) is None and os.environ["PREFECT_API_URL"] == url
        else:
            assert not [p for p in orphans if pid_alive(p)], "resume left the orphaned server running"
    done = rlake(["resume", "chain", "--home", str(home)], cli_env(None, COLUMNS="200"), home / "final.log")
    assert done.returncode == 0, tail(home / "final.log")
    # reuse, not regeneration: process k (resuming crash k-1, in iteration k-1) printed the reuse
    # report (rl_iteration skips generate_rollouts in that branch alone) exactly when crash k-1
    # came after the rows' commit and before the step's; during_generate and during_lake_append
    # leave nothing to reuse, during_mlflow_log a committed step
    logs = [home / f"crash-{k}.log" for k in range(1, len(POINTS))] + [home / "final.log"]
    for point, (k, log) in zip(POINTS, enumerate(logs), strict=True):
        line = f"iteration {k}: reusing its 16 samples already in the lake (no generation)"
        assert (line in log.read_text()) == (point in REUSING), (point, tail(log))
    assert ref.wait(timeout=900) == 0, tail(ref_log)
    assert prefect_servers(home / "prefect") == [], "a Prefect server process was left behind"

    run, chain_rows = _lake_invariants(home, "chain")
    _, ref_rows = _lake_invariants(ref_home, "ref")
    assert chain_rows.keys() == ref_rows.keys()
    assert len({r["reward"] for r in ref_rows.values()}) > 1, "the weights must depend on the data"
    for key, row in ref_rows.items():  # same prompts, same RNG draws: same trajectories
        assert chain_rows[key]["prompt"] == row["prompt"], key
        assert chain_rows[key]["response_token_ids"] == row["response_token_ids"], key
        assert chain_rows[key]["rollout_logprobs"] == row["rollout_logprobs"], key
    _mlflow_invariants(home, "chain", run["mlflow_run_id"])
    _prefect_invariants(url, "chain")

    ckpt = f"runs/{{}}/checkpoints/v{N_ITER:06d}/model.safetensors"
    a, b = load_file(home / ckpt.format("chain")), load_file(ref_home / ckpt.format("ref"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ from the uninterrupted run"
    kept = sorted(p.name for p in (home / "runs/chain/checkpoints").iterdir())
    assert kept == [f"v{N_ITER:06d}"], kept  # keep_checkpoints=1, nothing half-written left
