"""Resume after ``after_lake_append`` reuses the recorded samples (no generation), with dynamic
sampling, partial rollouts and ``max_staleness > 0`` (the data position is not 4 prompts per
iteration there); and when the commit's rollout stats are missing, resume warns and assumes a
plain rollout's position.

"No generation" is observed through the run's own report: the ``reuse`` event
(flows/durability.recorded_samples) prints "reusing its N samples already in the lake (no
generation)", and only that branch of ``rl_iteration`` skips ``generate_rollouts``; the Prefect
API must show no ``generate_rollouts`` task run for that iteration in the resuming process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from buffer import Lake
from buffer.lake import trajectory_guard
from rollout.context import ROLLOUT_STATS_KEY
from tests.opshelp import TINY, cli_env, read_until, rlake, shared_prefect_server, tail

N_ITER, CRASH = 4, 2
DYNAMIC = ["--set", "rollout.over_sampling_batch_size=6", "--set", "rollout.generation_chunk_tokens=2",
           "--set", "rollout.dynamic_sampling_filter_path=tests.test_rollout:even_row",
           "--set", "rollout.partial_rollout=true", "--set", "trainer.max_staleness=1"]
REUSED = f"iteration {CRASH}: reusing its 16 samples already in the lake (no generation)"


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    yield from shared_prefect_server(tmp_path_factory, "reuse-home")


def _args(home: Path, run_id: str) -> list[str]:
    return ["run", "--set", f"home={home}", "--set", f"run_id={run_id}", "--set", f"num_rollout={N_ITER}",
            "--set", f"eval.eval_interval={N_ITER}", "--set", "deterministic=true",
            "--set", "rollout.custom_rm_path=tests.opshelp:length_reward", *TINY, *DYNAMIC]


def _crash_after_append(home: Path, url: str, run_id: str) -> None:
    log = home / f"{run_id}-crash.log"
    proc = rlake(_args(home, run_id), cli_env(url, RLAKE_FAULT=f"after_lake_append:{CRASH}"), log)
    assert proc.returncode == -9, tail(log)


def _resume(home: Path, url: str, run_id: str) -> str:
    log = home / f"{run_id}-resume.log"
    proc = rlake(["resume", run_id, "--home", str(home)], cli_env(url, COLUMNS="200"), log)
    assert proc.returncode == 0, tail(log)
    return log.read_text()


def _steps(home: Path, run_id: str) -> list[dict]:
    steps = Lake(str(home / "lake")).read("train_steps", run_id=run_id).to_pylist()
    return sorted(steps, key=lambda s: s["step"])


def _generate_task_runs(url: str, run_id: str, expected: int) -> list[str]:
    """Iterations of the ``generate_rollouts`` task runs of ``run_id`` the Prefect server knows,
    once ``expected`` are there (task runs are recorded from events, late: CI once read 3 of 4)
    or two minutes passed."""
    return read_until(lambda: _read_generate_task_runs(url, run_id),
                      lambda found: len(found) >= expected)


def _read_generate_task_runs(url: str, run_id: str) -> list[str]:
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterTags,
        TaskRunFilter,
        TaskRunFilterName,
    )
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from infra.recovery import run_tag

    with temporary_settings({PREFECT_API_URL: url}), get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[run_tag(run_id)])),
            task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_="generate_rollouts")),
            limit=200)
        flows = {fr.id: fr for fr in client.read_flow_runs(
            flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[run_tag(run_id)])))}
    return [f"{flows[t.flow_run_id].parameters.get('iteration')}" for t in runs
            if t.flow_run_id in flows]


def test_resume_reuses_recorded_samples_with_dynamic_partial_staleness(shared, tmp_path):
    home, url = shared
    ref_home = tmp_path / "ref"
    ref_home.mkdir()
    # its own home (lake, MLflow, checkpoints), the shared Prefect server (no embedded start)
    ref = rlake(_args(ref_home, "ref"), cli_env(url), ref_home / "ref.log", background=True)
    _crash_after_append(home, url, "dyn")
    out = _resume(home, url, "dyn")
    assert REUSED in out, out[-3000:]
    assert out.count("reusing its") == 1, "only the interrupted iteration reuses samples"
    # generate_rollouts ran once per iteration except the reused one (the crashed process had
    # already run it for iteration CRASH)
    generated = sorted(_generate_task_runs(url, "dyn", N_ITER))
    assert generated == sorted(str(i) for i in range(N_ITER)), generated
    assert ref.wait(timeout=900) == 0, tail(ref_home / "ref.log")

    chain, reference = _steps(home, "dyn"), _steps(ref_home, "ref")
    positions = [json.loads(s["metrics"])["rollout/data_position_end"] for s in reference]
    assert positions != [4.0 * (i + 1) for i in range(N_ITER)], "dynamic sampling drew no extra prompts"
    kinds = Lake(str(ref_home / "lake")).read("trajectories", run_id="ref",
                                              columns=["kind"]).column(0).to_pylist()
    assert {"filtered", "partial"} <= set(kinds), set(kinds)
    for a, b in zip(chain, reference, strict=True):  # same position, samples, rollout stats
        ma, mb = json.loads(a["metrics"]), json.loads(b["metrics"])
        rollout = sorted(k for k in mb if k.startswith("rollout/") and "per_s" not in k)
        assert {k: ma[k] for k in rollout} == {k: mb[k] for k in rollout}, a["step"]
        assert [u.split("/", 1)[1] for u in a["sample_uids"]] == [u.split("/", 1)[1] for u in b["sample_uids"]]
    ckpt = f"runs/{{}}/checkpoints/v{N_ITER:06d}/model.safetensors"
    wa, wb = load_file(home / ckpt.format("dyn")), load_file(ref_home / ckpt.format("ref"))
    assert all(torch.equal(wa[k], wb[k]) for k in wb), "resumed weights differ from the uninterrupted run"


def _strip_rollout_stats(lake_dir: Path, run_id: str, iteration: int) -> None:
    """Rewrite the trajectories commit of (run_id, iteration) without its rollout stats, as
    rows written before the stats were committed with them would be."""
    guard = trajectory_guard(run_id, iteration)
    stripped = 0
    for commit in sorted((lake_dir / "trajectories" / "_delta_log").glob("*.json")):
        lines = commit.read_text().splitlines()
        for i, line in enumerate(lines):
            action = json.loads(line)
            info = action.get("commitInfo")
            if info and guard in json.loads(info.get("rlake.guards", "[]")) and ROLLOUT_STATS_KEY in info:
                del info[ROLLOUT_STATS_KEY]
                lines[i] = json.dumps(action)
                commit.write_text("\n".join(lines) + "\n")
                stripped += 1
    assert stripped == 1, stripped


def test_resume_without_rollout_stats_warns_and_assumes_a_plain_position(shared):
    home, url = shared
    _crash_after_append(home, url, "nostats")
    lake = Lake(str(home / "lake"))
    assert ROLLOUT_STATS_KEY in lake.trajectory_commit_info("nostats", CRASH)
    before = json.loads(_steps(home, "nostats")[CRASH - 1]["metrics"])["rollout/data_position_end"]
    _strip_rollout_stats(home / "lake", "nostats", CRASH)
    assert ROLLOUT_STATS_KEY not in (Lake(str(home / "lake")).trajectory_commit_info("nostats", CRASH) or {})
    out = _resume(home, url, "nostats")
    assumed = int(before) + 4  # rollout_batch_size prompts after the previous iteration's end
    assert f"iteration {CRASH}: no rollout stats in the lake; data position assumed {assumed}" in out, out[-3000:]
    assert REUSED in out
    steps = _steps(home, "nostats")
    assert json.loads(steps[CRASH]["metrics"])["rollout/data_position_end"] == assumed
    # the next iteration drew its prompts from the assumed position on
    nxt = json.loads(steps[CRASH + 1]["metrics"])
    assert nxt["rollout/data_position_end"] == assumed + nxt["rollout/prompts_drawn"]
