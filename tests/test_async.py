"""Async mode (``mode: async``): the rollout side runs ahead of training in its own process.

Through the real CLI, asserted on the records: the staleness bound on every trained sample (the
lake rows and ``train_steps``), the link between each iteration's Prefect flow run and the
rollout batch's task run, a ``kill -9`` then ``rlake resume`` that trains the samples appended
before the kill instead of regenerating them, and learning (held-out accuracy, paired test).
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from buffer import Lake
from infra.config import ConfigError, config_from_dict
from infra.recovery import run_tag
from tests.learning import EVAL_INTERVAL, LATE_VERSIONS, LEARN_ITERATIONS, assert_learned, paired_gain
from tests.opshelp import TINY, cli_env, pids_with_env, read_until, rlake, shared_prefect_server, tail

K = 2
N_ITER = 6
PER_BATCH = 4 * 4  # TINY: 4 prompts x 4 samples
LENGTH_REWARD = "tests.opshelp:length_reward"  # the tiny model never gets an addition right


def test_mode_is_validated_and_async_turns_the_correction_on():
    assert config_from_dict({}).mode == "sync"
    with pytest.raises(ConfigError, match="trainer.max_staleness >= 1"):
        config_from_dict({"mode": "async"})
    with pytest.raises(ConfigError, match="'mode'"):
        config_from_dict({"mode": "later"})
    with pytest.raises(ConfigError, match="rollout.engine 'torch' only"):
        config_from_dict({"mode": "async", "trainer": {"max_staleness": 1},
                          "rollout": {"engine": "sglang"}})
    cfg = config_from_dict({"mode": "async", "trainer": {"max_staleness": 1}})
    assert cfg.trainer.use_tis, "async mode trains stale samples with the off-policy correction"
    off = config_from_dict({"mode": "async", "trainer": {"max_staleness": 1, "use_tis": False}})
    assert not off.trainer.use_tis, "an explicit choice wins"
    assert not config_from_dict({"trainer": {"max_staleness": 1}}).trainer.use_tis


def test_rollout_side_resumes_after_the_newest_batch_at_its_committed_position(tmp_path):
    from buffer.synth import synthetic_rows
    from infra.sides import batches_in_lake, resume_position
    from rollout.context import RolloutOutput

    lake = Lake(str(tmp_path / "lake"))
    assert resume_position(lake, "r", 4) == (0, 0)
    for batch, position in ((0, 5), (1, 11)):  # e.g. dynamic sampling drew more than 4 prompts
        info = RolloutOutput(groups=[], stats={"rollout/data_position_end": float(position)})
        lake.append_trajectories(synthetic_rows("r", batch, n=8), commit_info=info.commit_info())
    lake.append_trajectories(synthetic_rows("r", 7, n=8, kind="eval"))  # not a rollout batch
    assert batches_in_lake(lake, "r") == [0, 1]
    assert resume_position(lake, "r", 4) == (2, 11)
    lake.append_trajectories(synthetic_rows("r", 2, n=8))  # rows without stats: 4 per batch
    assert resume_position(lake, "r", 4) == (3, 12)


def test_mailbox_keeps_the_newest_weights_and_sees_stop():
    """Weights come before their commit: the mailbox keeps the newest weights and, apart, the
    newest committed version, which the rollout side's append waits for."""
    import multiprocessing
    import os

    from flows.rollout_side import Mailbox

    q = multiprocessing.get_context("spawn").Queue()
    box = Mailbox(q, os.getppid())
    for version in (3, 5, 4):
        q.put(("weights", version, f"w{version}".encode()))
    q.put(("committed", 4))
    q.put(("committed", 3))
    box.wait_for(5)
    assert box.wait_committed(4)
    assert (box.version, box.payload, box.committed, box.stopped) == (5, b"w5", 4, False)
    q.put(("stop",))
    box.wait_for(9)  # returns on stop instead of waiting for version 9
    assert box.stopped and box.version == 5
    assert not box.wait_committed(5)  # stopped before version 5 was committed: no append
    q.close()


@pytest.mark.parametrize("k", [1, 2])
def test_the_rollout_side_generates_batch_b_with_version_b_minus_k_at_the_oldest(monkeypatch, k):
    """``produce`` waits for version b - k before batch b, no less (AReaL's bound, the one
    ``train_steps`` staleness is held to): a trainer that hands out the next version only when
    the rollout side blocks for it sees batch b generated with version max(0, b - k) exactly.
    The end-to-end staleness test missed a bound of k + 1 (``b - k - 1``; mutation review,
    2026-11-29): its rollout side seldom runs that far ahead."""
    import os
    import queue
    from types import SimpleNamespace

    import infra.env
    import tasks.async_batches
    from flows.rollout_side import Mailbox, produce

    generated: list[tuple[int, int]] = []  # (batch, weight version it was generated with)
    n_batches = 6

    class Side:
        cfg = SimpleNamespace(trainer=SimpleNamespace(max_staleness=k))
        next_batch = 0
        engine = SimpleNamespace(weight_version=-1)

        def load_weights(self, payload, version):
            assert payload == f"w{version}"
            self.engine.weight_version = version

        def seed_batch(self, batch):
            pass

    def rollout_batch(side, batch, send_rows, may_append):
        generated.append((batch, side.engine.weight_version))
        send_rows({}, None)
        assert may_append()  # its version is committed (with its weights, below)
        return {}, batch

    class Trainer:
        """The inbox: the next version (weights, then its commit) only when the side blocks."""
        def __init__(self):
            self.pending = [("weights", 0, "w0"), ("committed", 0)]
            self.version = 0

        def get_nowait(self):
            if not self.pending:
                raise queue.Empty
            return self.pending.pop(0)

        def get(self, timeout=None):
            if self.pending:
                return self.pending.pop(0)
            if self.version >= n_batches:  # never reached with the bound kept
                return ("stop",)
            self.version += 1
            self.pending.append(("committed", self.version))
            return ("weights", self.version, f"w{self.version}")

    monkeypatch.setattr(tasks.async_batches, "rollout_batch", rollout_batch)
    monkeypatch.setattr(infra.env, "freeze_startup_heap", lambda: None)
    sent: list[tuple] = []
    produce(Side(), Mailbox(Trainer(), os.getppid()), SimpleNamespace(put=sent.append), n_batches)
    assert generated == [(b, max(0, b - k)) for b in range(n_batches)]
    assert max(b - w for b, w in generated) == k
    assert [m[:2] for m in sent if m[0] == "appended"] == [("appended", b) for b in range(n_batches)]


def test_a_rollout_process_with_nothing_left_to_generate_ends_and_the_run_goes_on(server, tmp_path):
    """A resume can find every batch already in the lake: its rollout process then ends at once
    (exit 0). That is an error only while a batch is awaited from it (CI caught the training
    side raising "the rollout process exited (code 0)" for a batch the lake held)."""
    from buffer.synth import synthetic_rows
    from flows.async_run import RolloutProcess
    from flows.durability import close_runtime
    from infra.config import load_config
    from infra.runtime import open_runtime
    from tests.conftest import REPO

    _, url = server
    cfg = load_config(REPO / "configs" / "quickstart.yaml", [
        f"home={tmp_path / 'home'}", "mode=async", f"trainer.max_staleness={K}", "num_rollout=3",
        *[TINY[i + 1] for i in range(0, len(TINY), 2)]])
    rt = open_runtime(cfg, "all-in-lake")
    producer = None
    try:
        for batch in range(3):  # every batch of the run, appended before this process
            rt.lake.append_trajectories(synthetic_rows("all-in-lake", batch, n=PER_BATCH))
        producer = RolloutProcess(rt).start(url)
        producer.spawned.proc.join(timeout=300)  # a hang guard
        assert producer.spawned.proc.exitcode == 0, "nothing to generate: it ends, successfully"
        for batch in range(3):
            producer.wait_for_batch(batch)  # in the lake: nothing awaited from it
        with pytest.raises(RuntimeError, match=r"the rollout process exited \(code 0\)"):
            producer.wait_for_batch(3)  # awaited from a process that is gone
    finally:
        if producer is not None:
            producer.stop()
        close_runtime(rt)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from shared_prefect_server(tmp_path_factory, "async-home")


def _args(home, run_id, n_iter=N_ITER, eval_interval=None):
    return ["run", "--set", f"home={home}", "--set", f"run_id={run_id}", "--set", "mode=async",
            "--set", f"trainer.max_staleness={K}", "--set", f"num_rollout={n_iter}",
            "--set", f"eval.eval_interval={eval_interval or n_iter}",
            "--set", f"rollout.custom_rm_path={LENGTH_REWARD}",
            *TINY]


def _records(home, run_id):
    lake = Lake(str(home / "lake"))
    train = [r for r in lake.read("trajectories", run_id=run_id,
                                  columns=["sample_uid", "iteration", "kind", "weight_version",
                                           "response_token_ids", "created_at"]).to_pylist()
             if r["kind"] == "train"]
    steps = sorted(lake.read("train_steps", run_id=run_id).to_pylist(), key=lambda s: s["step"])
    return train, steps


def _check_bound_and_accounting(train, steps, n_iter):
    """Every batch trained once, by the iteration of its number, within K versions."""
    uids = [r["sample_uid"] for r in train]
    assert len(uids) == len(set(uids)), "a trajectory row is duplicated"
    assert sorted({r["iteration"] for r in train}) == list(range(n_iter))
    assert all(sum(r["iteration"] == i for r in train) == PER_BATCH for i in range(n_iter))
    assert [(s["step"], s["base_version"], s["weight_version"]) for s in steps] == \
        [(i, i, i + 1) for i in range(n_iter)]
    by_uid = {r["sample_uid"]: r for r in train}
    consumed = [u for s in steps for u in s["sample_uids"]]
    assert sorted(consumed) == sorted(uids), "a sample trained twice or never"
    for s in steps:
        rows = [by_uid[u] for u in s["sample_uids"]]
        assert {r["iteration"] for r in rows} == {s["step"]}, "iteration i trains on batch i"
        lags = [s["base_version"] - r["weight_version"] for r in rows]
        assert all(0 <= lag <= K for lag in lags), (s["step"], lags)
        assert s["staleness_max"] == max(lags) <= K
    # the rollout side drew the next 4 prompts per batch, across restarts too
    positions = [json.loads(s["metrics"]).get("rollout/data_position_end") for s in steps]
    assert positions == [4.0 * (i + 1) for i in range(n_iter)], positions


def _prefect_runs(api_url, run_id, deadline_s=60.0):
    """(flow runs by flow name, tagged with the run; the rollout side's rollout_batch task
    runs); waits for the task runs, which Prefect's batched recorder writes a few seconds late (a
    hang guard, not a timing check)."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterTags,
        TaskRunFilter,
        TaskRunFilterFlowRunId,
    )
    from prefect.settings import PREFECT_API_URL, temporary_settings

    def read(client) -> tuple[dict[str, list], list]:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            tags=FlowRunFilterTags(all_=[run_tag(run_id)])))
        names = {fid: client.read_flow(fid).name for fid in {r.flow_id for r in runs}}
        by_flow: dict[str, list] = {}
        for r in runs:
            by_flow.setdefault(names[r.flow_id], []).append(r)
        producer = [r.id for r in by_flow.get("rollout_side", [])]
        # task runs carry no tags (flows.prefetch.untagged): found through their flow run
        tasks = client.read_task_runs(task_run_filter=TaskRunFilter(
            flow_run_id=TaskRunFilterFlowRunId(any_=producer))) if producer else []
        return by_flow, [t for t in tasks if t.name.startswith("rollout_batch")
                         and t.state_type and t.state_type.value == "COMPLETED"]

    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        return read_until(lambda: read(client), lambda found: len(found[1]) >= N_ITER, deadline_s)


def _task_runs(api_url, flow_run_ids):
    from prefect import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterFlowRunId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        return client.read_task_runs(task_run_filter=TaskRunFilter(
            flow_run_id=TaskRunFilterFlowRunId(any_=flow_run_ids)))


@pytest.fixture(scope="module")
def async_run(server):
    home, url = server
    log = home / "run.log"
    proc = rlake(_args(home, "bound"), cli_env(url), log)
    assert proc.returncode == 0, tail(log)
    return home, url


def test_no_trained_sample_is_older_than_k_versions(async_run):
    home, _ = async_run
    train, steps = _records(home, "bound")
    _check_bound_and_accounting(train, steps, N_ITER)
    # the rollout side did run ahead: batch b generated with weights older than b (without
    # overlap every lag would be 0 and the bound would hold trivially)
    assert max(s["staleness_max"] for s in steps) >= 1, [s["staleness_max"] for s in steps]
    assert all(s["metrics"] and '"train/tis_weight_mean"' in s["metrics"] for s in steps)


def test_rollout_batches_are_prefect_task_runs_linked_to_iterations(async_run):
    home, url = async_run
    by_flow, batches = _prefect_runs(url, "bound")
    [producer] = by_flow["rollout_side"]  # the rollout process's one flow run
    assert producer.state_type.value == "COMPLETED"
    iterations = by_flow["rl_iteration"]
    assert len(iterations) == N_ITER and all(f.state_type.value == "COMPLETED" for f in iterations)

    def batch_of(run) -> str:
        return next(x for x in run.tags if x.startswith("rlake-batch:")).split(":")[1]

    # each batch's task run is named after it, untagged (flows.prefetch.untagged)
    assert sorted(t.name for t in batches) == sorted(f"rollout_batch-{i}" for i in range(N_ITER))
    assert not [t.name for t in batches if t.tags]
    # the task runs of the iterations whose runs were created ahead (all but the first) carry
    # no tags either: a tagged task run costs a tag-concurrency request (flows.prefetch.untagged)
    ahead = [f.id for f in iterations if f.parameters["iteration"] > 0]
    tagged = [(t.name, t.tags) for t in _task_runs(url, ahead) if t.tags]
    assert not tagged, tagged
    # each iteration names the batch it trained on, which the lake confirms
    _, steps = _records(home, "bound")
    trained = {s["step"]: {u.split("/")[1] for u in s["sample_uids"]} for s in steps}
    for f in iterations:
        assert trained[f.parameters["iteration"]] == {batch_of(f)}


def test_kill9_then_resume_trains_what_the_lake_holds(server):
    home, url = server
    mark = uuid.uuid4().hex
    log = home / "crash.log"
    # version 3 is evaluated after batch 3 is in the lake (the rollout side runs ahead): its
    # rows must not hide the batch's rollout stats from the resume (data positions, below)
    proc = rlake(_args(home, "crash", eval_interval=3),
                 cli_env(url, RLAKE_FAULT="during_train:3", RLAKE_TEST_MARK=mark), log)
    assert proc.returncode == -signal.SIGKILL, tail(log)
    end = time.monotonic() + 30  # PR_SET_PDEATHSIG: the rollout process dies with the run
    while pids_with_env("RLAKE_TEST_MARK", mark) and time.monotonic() < end:
        time.sleep(0.5)
    assert pids_with_env("RLAKE_TEST_MARK", mark) == [], "the rollout process outlived the kill"

    before, steps = _records(home, "crash")
    assert [s["step"] for s in steps] == [0, 1, 2]
    consumed = {u for s in steps for u in s["sample_uids"]}
    pending = {r["sample_uid"]: r for r in before if r["sample_uid"] not in consumed}
    assert {r["iteration"] for r in pending.values()} >= {3}, "batch 3 was being trained"
    assert max(r["iteration"] for r in before) <= 3 + K, "the rollout side ran past the bound"

    done = rlake(["resume", "crash", "--home", str(home)], cli_env(url), home / "resume.log")
    assert done.returncode == 0, tail(home / "resume.log")
    after, steps = _records(home, "crash")
    _check_bound_and_accounting(after, steps, N_ITER)
    later = {u for s in steps[3:] for u in s["sample_uids"]}
    assert set(pending) <= later, "samples appended before the kill must be trained after it"
    rows = {r["sample_uid"]: r for r in after}
    for uid, row in pending.items():  # the same rows, not regenerated ones
        assert rows[uid]["created_at"] == row["created_at"], uid
        assert rows[uid]["response_token_ids"] == row["response_token_ids"], uid


def _rollout_pid(mark: str, parent: int) -> int | None:
    """The rollout process of the run ``parent`` (a child of it carrying the test's mark)."""
    from infra.recovery import parent_pid

    kids = [p for p in pids_with_env("RLAKE_TEST_MARK", mark) if parent_pid(p) == parent]
    return next((p for p in kids if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text(
        errors="replace")), None)


def test_kill9_of_the_rollout_process_fails_the_run_and_resume_completes(server):
    home, url = server
    mark = uuid.uuid4().hex
    log = home / "rollout-crash.log"
    # enough iterations that the rollout side (k ahead) cannot have finished its last batch and
    # exited by the time two batches are seen in the lake
    n_iter = 20
    run = rlake(_args(home, "rollout-crash", n_iter), cli_env(url, RLAKE_TEST_MARK=mark), log,
                background=True)
    lake = Lake(str(home / "lake"))
    end = time.monotonic() + 600  # hang guard: wait for two batches in the lake
    while time.monotonic() < end and run.poll() is None:
        rows = lake.read("trajectories", run_id="rollout-crash", columns=["iteration", "kind"])
        if len({i for i, k in zip(rows.column("iteration").to_pylist(),
                                  rows.column("kind").to_pylist(), strict=True) if k == "train"}) >= 2:
            break
        time.sleep(0.5)
    pid = _rollout_pid(mark, run.pid)
    assert pid is not None and run.poll() is None, tail(log)
    if len(os.sched_getaffinity(0)) >= 2:  # pin_cores: the two sides on cores of their own
        trainer_cores, rollout_cores = os.sched_getaffinity(run.pid), os.sched_getaffinity(pid)
        assert len(trainer_cores) == 1 and not trainer_cores & rollout_cores, (trainer_cores,
                                                                               rollout_cores)
    os.kill(pid, signal.SIGKILL)
    assert run.wait(timeout=600) not in (0, -signal.SIGKILL), tail(log)
    assert "rollout process exited" in tail(log)
    # the command that continues it, as printed: with its home (it said `rlake resume` alone)
    assert f"`rlake resume rollout-crash --home {home}` continues" in log.read_text(), tail(log)
    assert Lake(str(home / "lake")).get_run("rollout-crash")["status"] == "failed"

    done = rlake(["resume", "rollout-crash", "--home", str(home)], cli_env(url), home / "r2.log")
    assert done.returncode == 0, tail(home / "r2.log")
    _check_bound_and_accounting(*_records(home, "rollout-crash"), n_iter)


LEARN_K = 1  # measured (one seed, under load): k=1 +0.138 (6.7 SE) in 40 iterations, k=2 +0.026


def test_async_rl_improves_held_out_accuracy(tmp_path, cli, warm_model):
    """Learning, measured: greedy accuracy on 500 held-out problems after async RL (the late
    versions, averaged) vs before, paired per problem; the gain must exceed 3 standard errors."""
    home = tmp_path / "learn"
    cli(["run", "configs/quickstart.yaml", "--run-id", "learn", "--set", "mode=async",
         "--set", f"trainer.max_staleness={LEARN_K}", "--set", f"model.path={warm_model['checkpoint']}",
         "--set", "sft.enabled=false", "--set", f"home={home}", "--set", f"num_rollout={LEARN_ITERATIONS}",
         "--set", f"eval.eval_interval={EVAL_INTERVAL}",
         "--set", "prefect_task_runs=false"],  # learning is the subject (tests/test_task_runs.py)
        env={"PREFECT_HOME": str(home / "prefect")})
    lake = Lake(str(home / "lake"))
    assert paired_gain(lake, "learn", 0, LATE_VERSIONS)[2] == 500
    assert_learned(lake, "learn", 0, LATE_VERSIONS)  # >= 3 SE (tests/learning.py)
    steps = lake.read("train_steps", run_id="learn", columns=["staleness_max"]).to_pylist()
    assert max(s["staleness_max"] for s in steps) <= LEARN_K
