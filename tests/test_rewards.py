"""Reward registry, math/f1/exact/countdown verifiers, failure handling, remote reward model."""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rewards import registry
from rewards.concurrent import run_concurrently
from rewards.math import answers_equal, extract_answer, last_boxed, normalize_answer
from rewards.registry import Scorer, bounded, get_reward_fn, score_samples
from rewards.tasks import countdown_problems, countdown_reward, evaluate_expression, load_task
from rewards.text import f1_score
from rollout.sample import Sample, Status


def _sample(response: str, label: str | None = None, **metadata) -> Sample:
    return Sample(group_index=0, index=0, prompt="p", prompt_token_ids=[1], label=label,
                  response=response, metadata=metadata)


@pytest.mark.parametrize("text, answer", [
    ("so \\boxed{42}.", "42"),
    ("first \\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("nested \\boxed{x^{2}+1} done", "x^{2}+1"),
    ("The answer is 17.", "17"),
    ("we get 3 then 5 then -7", "-7"),
    ("no digits here", None),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_last_boxed_unbalanced_is_none():
    assert last_boxed("\\boxed{12") is None


@pytest.mark.parametrize("a, b, equal", [
    ("0.5", "1/2", True), ("\\frac{1}{2}", "0.5", True), ("\\dfrac{3}{4}", "0.75", True),
    ("1,000", "1000", True), ("$12$", "12", True), ("50\\%", "50", True), ("10", "10.0", True),
    ("\\frac12", "0.5", True), ("\\text{7}", "7", True), ("3", "4", False), ("1/3", "0.33", False),
    ("x+1", "x + 1", True), ("x+1", "x+2", False),
])
def test_answers_equal(a, b, equal):
    assert answers_equal(a, b) is equal


def test_normalize_answer_strips_latex():
    assert normalize_answer("\\left( 3 \\right)") == "(3)"


def test_f1_score():
    assert f1_score("the cat sat", "cat sat") == 1.0
    assert f1_score("cat", "dog") == 0.0
    assert f1_score("a cat on mat", "cat on a hat") == pytest.approx(2 * (2 / 3) * (2 / 3) / (4 / 3))


def test_registry_names_and_boxed_prefix():
    scorer = Scorer(rm_type="boxed_exact")
    assert scorer(_sample("work... \\boxed{85}", "85")) == 1.0
    assert scorer(_sample("85", "85")) == 0.0  # no box: 0
    assert Scorer(rm_type="math")(_sample("It is \\boxed{0.5}", "1/2")) == 1.0
    assert Scorer(rm_type="f1")(_sample("red car", "the red car")) == 1.0
    assert get_reward_fn("boxed_math")("\\boxed{2/4}", "0.5", {}) == 1.0
    with pytest.raises(ValueError, match="unknown rm_type 'nope'"):
        Scorer(rm_type="nope")


def test_per_sample_rm_type_override():
    scorer = Scorer(rm_type="exact")
    assert scorer(_sample("The answer is 0.5", "1/2")) == 0.0
    assert scorer(_sample("The answer is 0.5", "1/2", rm_type="math")) == 1.0


def custom_rm(cfg, sample):
    return {"score": len(sample.response) / 10, "cfg_seen": cfg is not None}


def test_custom_rm_path_gets_cfg_and_sample():
    scorer = Scorer(rm_type="exact", custom_rm_path="tests.test_rewards:custom_rm", cfg={"x": 1})
    s = _sample("abcde")
    assert score_samples([s], scorer) == 0
    assert s.reward == 0.5 and s.reward_detail["cfg_seen"] is True


def test_countdown_generator_and_verifier():
    problems = countdown_problems()
    assert len({p["prompt"] for p in problems}) == len(problems)
    for p in problems[::97]:
        meta = p["metadata"]
        assert countdown_reward(meta["solution"], p["label"], meta) == 1.0
    meta = {"numbers": [3, 5, 7], "target": 22}
    assert countdown_reward("3*5+7", "22", meta) == 1.0
    assert countdown_reward("7+3*5", "22", meta) == 1.0
    assert countdown_reward("3*5+7+0", "22", meta) == 0.0   # 0 is not a given number
    assert countdown_reward("3*7+1", "22", meta) == 0.0     # wrong numbers
    assert countdown_reward("__import__('os')", "22", meta) == 0.0
    assert countdown_reward("22", "22", meta) == 0.0
    split = load_task("countdown", 100)
    assert len(split.held_out) == 100 and len(split.train) == len(problems) - 100
    assert evaluate_expression("(8-2)/4")[0] == 1.5


def _raises(response, label, metadata):
    raise KeyError("boom")


def _nan(response, label, metadata):
    return math.nan


def _hangs(response, label, metadata):
    time.sleep(3600)


def test_score_samples_failures_marked_and_counted():
    samples = [_sample(str(i), str(i)) for i in range(6)]
    fns = {"0": lambda r, lab, m: 1.0, "1": _raises, "2": _nan, "3": lambda r, lab, m: math.inf,
           "4": lambda r, lab, m: {"score": -math.inf}, "5": lambda r, lab, m: "inf"}
    failed = score_samples(samples, lambda r, lab, m: fns[r](r, lab, m))
    assert failed == 5
    assert samples[0].reward == 1.0 and samples[0].status == Status.PENDING
    assert samples[1].status == Status.FAILED and "KeyError" in samples[1].reward_detail["error"]
    assert "NaN" in samples[2].reward_detail["error"] and samples[2].reward == 0.0
    for s, shown in zip(samples[3:5], ["inf", "-inf"], strict=True):
        assert s.status == Status.FAILED and s.reward == 0.0
        assert s.reward_detail["error"] == f"ValueError: reward is {shown} (not a finite number)"
    # a string is not a number, even one float() would parse: refused with its type
    assert samples[5].status == Status.FAILED and samples[5].reward == 0.0
    assert "returned str 'inf': return a number or {'score': number}" in samples[5].reward_detail["error"]


def test_hung_reward_times_out_and_others_still_score():
    samples = [_sample("hang"), *[_sample(str(i), str(i)) for i in range(5)]]
    fn = lambda r, lab, m: _hangs(r, lab, m) if r == "hang" else 1.0  # noqa: E731
    failed = score_samples(samples, fn, timeout_s=0.3, max_workers=1)  # the hung call holds the only slot
    assert failed == 1
    assert samples[0].reward_detail["error"] == "timed out after 0.3s"
    assert [s.reward for s in samples[1:]] == [1.0] * 5


def test_built_in_rewards_run_inline_registered_ones_in_threads(monkeypatch):
    """Ours (bounded in time) score in the calling thread; a function registered under a name,
    even a built-in one, runs in a worker thread under the time limit."""
    assert bounded("addition") and bounded("boxed_math") and not bounded("remote")
    seen = []

    def slow(response, label, metadata):
        seen.append(threading.current_thread().name)
        time.sleep(5 if response == "hang" else 0)
        return 1.0

    samples = [_sample("7", "7"), _sample("The answer is 0.5", "1/2", rm_type="math")]
    assert score_samples(samples, Scorer(rm_type="addition")) == 0
    assert [s.reward for s in samples] == [1.0, 1.0]
    monkeypatch.setitem(registry.REGISTRY, "exact", slow)
    assert not bounded("exact") and not bounded("boxed_exact")
    hung = [_sample("hang"), _sample("ok")]
    assert score_samples(hung, Scorer(rm_type="exact"), timeout_s=0.3) == 1
    assert hung[0].reward_detail["error"] == "timed out after 0.3s" and hung[1].reward == 1.0
    assert seen and all(name.startswith("rlake-reward-") for name in seen)


def test_a_raising_built_in_reward_fails_only_its_sample(monkeypatch):
    scorer = Scorer(rm_type="addition")
    monkeypatch.setattr(scorer, "_resolve", lambda rm_type: lambda s: int(s.response))
    samples = [_sample("12"), _sample("twelve")]
    assert score_samples(samples, scorer) == 1
    assert samples[0].reward == 12.0 and samples[1].status == Status.FAILED
    assert samples[1].reward_detail["error"].startswith("ValueError: invalid literal")


def test_run_concurrently_order_and_errors():
    out = run_concurrently([lambda i=i: i * i for i in range(20)] + [lambda: 1 / 0], 5.0, 4)
    assert [o.value for o in out[:20]] == [i * i for i in range(20)]
    assert not out[20].ok and out[20].error.startswith("ZeroDivisionError")


class _Handler(BaseHTTPRequestHandler):
    calls: list[dict] = []
    fail_first = 0

    def do_POST(self):  # noqa: N802 - http.server API
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).calls.append(body)
        if body["response"] == "slow":
            time.sleep(1.0)
        if body["response"] == "bad":
            self.send_response(400)
            self.end_headers()
            return
        if len(type(self).calls) <= type(self).fail_first:
            self.send_response(503)
            self.end_headers()
            return
        reply = {"score": 1.0 if body["response"] == body["label"] else 0.0, "judge": "local"}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def rm_server():
    _Handler.calls, _Handler.fail_first = [], 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.handle_error = lambda *args: None  # a client that timed out: broken pipe, expected
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/reward"
    server.shutdown()
    server.server_close()


def test_remote_reward_scores_and_retries(rm_server):
    _Handler.fail_first = 2  # two 503s, then success
    scorer = Scorer(rm_type="remote", rm_url=rm_server, remote_retries=2)
    s = _sample("85", "85", task="addition")
    assert score_samples([s], scorer) == 0
    assert s.reward == 1.0 and s.reward_detail["judge"] == "local"
    assert len(_Handler.calls) == 3 and _Handler.calls[-1]["metadata"] == {"task": "addition"}


def test_remote_reward_failures(rm_server):
    scorer = Scorer(rm_type="remote", rm_url=rm_server, remote_timeout_s=0.2, remote_retries=1)
    slow, bad = _sample("slow", "x"), _sample("bad", "x")
    assert score_samples([slow, bad], scorer) == 2
    assert "failed after 2 attempts" in slow.reward_detail["error"]
    assert "HTTP 400" in bad.reward_detail["error"]
    assert [c["response"] for c in _Handler.calls].count("bad") == 1  # 4xx is not retried
    with pytest.raises(ValueError, match="rm_url"):
        Scorer(rm_type="remote")


def test_many_concurrent_countdown_scores_all_succeed():
    """Scoring runs in threads (an end-to-end run once hit CPython's "AST constructor recursion
    depth mismatch" SystemError in ast.parse; parsing is now under a lock; this test does not
    reproduce that race reliably, it checks concurrent scoring gives every sample its score)."""
    meta = {"numbers": [7, 4, 9], "target": 43}
    samples = [_sample("7+(4*9)", None, **meta) for _ in range(400)]
    assert score_samples(samples, Scorer(rm_type="countdown", max_workers=16)) == 0
    assert all(s.reward == 1.0 for s in samples)


def spin_reward(cfg, sample):
    """custom_rm_path shape: busy-loops (never returns) on the response "spin", after writing its
    process id to ``metadata["pid_file"]``; otherwise 1.0 and the worker's pid."""
    import os
    from pathlib import Path

    if sample.response == "spin":
        Path(sample.metadata["pid_file"]).write_text(str(os.getpid()))
        while True:
            pass
    return {"score": 1.0, "pid": os.getpid()}


def _pid_alive(pid: int) -> bool:
    from pathlib import Path

    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


def test_busy_looping_custom_reward_is_killed_and_its_worker_replaced(tmp_path):
    pid_file = tmp_path / "spin.pid"
    scorer = Scorer(rm_type="exact", custom_rm_path="tests.test_rewards:spin_reward",
                    timeout_s=5.0, max_workers=2)
    try:
        samples = [_sample("spin", pid_file=str(pid_file)), *[_sample(str(i)) for i in range(6)]]
        assert score_samples(samples, scorer) == 1
        spun = int(pid_file.read_text())
        assert samples[0].status == Status.FAILED
        assert samples[0].reward_detail["error"] == "timed out after 5.0s"
        assert [s.reward for s in samples[1:]] == [1.0] * 6
        # the other worker scored the rest while the first spun; the spinning process is gone
        assert {s.reward_detail["pid"] for s in samples[1:]} != {spun}
        assert not _pid_alive(spun) and spun not in scorer.workers.pids()
        assert scorer.workers.replaced == 1
        again = [_sample(str(i)) for i in range(4)]
        assert score_samples(again, scorer) == 0
        assert spun not in {s.reward_detail["pid"] for s in again}
        workers = scorer.workers.pids()
    finally:
        scorer.close()
    assert workers and not any(_pid_alive(p) for p in workers)


def _seed_inf(lake, run_id: str, iteration: int, indices: set[int]) -> None:
    """Rewrite (run_id, iteration)'s trajectories with reward +inf at ``indices``, as an older
    rlake wrote them: delete the iteration's rows, append them again through the lake (with the
    same rollout stats in the commit). A deltalake UPDATE would rewrite the file with string_view
    columns, which the lake's slice filter cannot compare: not what an rlake lake holds."""
    import deltalake

    from rollout.context import ROLLOUT_STATS_KEY

    info = lake.trajectory_commit_info(run_id, iteration) or {}
    rows = [r for r in lake.read("trajectories", run_id=run_id).to_pylist() if r["iteration"] == iteration]
    for r in rows:
        if r["kind"] == "train" and r["sample_index"] in indices:
            r["reward"] = math.inf
    deltalake.DeltaTable(f"{lake.uri}/trajectories").delete(
        f"run_id = '{run_id}' AND iteration = {iteration}")
    kept = {k: info[k] for k in (ROLLOUT_STATS_KEY,) if k in info}
    lake.append_trajectories(rows, commit_info=kept or None)


def test_lake_rows_with_inf_rewards_read_back_as_failed_and_train(tmp_path):
    from buffer import Lake
    from buffer.synth import synthetic_rows
    from tests.trainer_fixtures import build_model, trainer
    from trainers.base import TrainBatch
    from trainers.metrics import rollout_metrics

    lake = Lake(str(tmp_path / "lake"))
    lake.append_trajectories(synthetic_rows("r", 0, 8, prompt_len=4, response_len=3, seed=1))
    _seed_inf(lake, "r", 0, {1, 5})
    rows = lake.training_slice("r", 0, 0)
    assert sorted(rows.column("reward").to_pylist())[-2:] == [math.inf, math.inf]
    samples = [Sample.from_row(r) for r in rows.to_pylist()]
    bad = [s for s in samples if s.index in (1, 5)]
    assert all(s.status == Status.FAILED and s.reward == 0.0 for s in bad)
    assert bad[0].reward_detail["error"] == "reward is inf (not a finite number)"
    assert math.isfinite(rollout_metrics(samples, 1.0)["rollout/reward_std"])
    batch = TrainBatch.from_arrow(rows)
    assert all(math.isfinite(r) for r in batch.rewards) and batch.rewards.count(0.0) >= 2
    batch.prompt_token_ids = [[t % 26 + 4 for t in p] for p in batch.prompt_token_ids]  # tiny vocab
    batch.response_token_ids = [[t % 26 + 4 for t in r] for r in batch.response_token_ids]
    stats = trainer(build_model(tmp_path), 8).train(batch)
    assert all(math.isfinite(v) for v in stats.values() if isinstance(v, float))


def test_resume_over_a_lake_holding_inf_rewards(tmp_path):
    """A run killed after iteration 0's lake append, whose rows then hold +inf rewards (as rlake
    wrote them before rewards were checked), resumes, reuses those rows as failed samples and
    finishes (it used to fail on every resume: "'float' object has no attribute 'numerator'")."""
    from buffer import Lake
    from tests.opshelp import TINY, cli_env, rlake, tail

    home = tmp_path / "home"
    args = ["--set", f"home={home}", "--set", "num_rollout=1", *TINY]
    killed = rlake(["run", "--set", "run_id=inf", *args], cli_env(None, RLAKE_FAULT="after_lake_append:0"),
                   tmp_path / "run.log")
    assert killed.returncode != 0, tail(tmp_path / "run.log")
    lake = Lake(str(home / "lake"))
    assert lake.read("train_steps", run_id="inf").num_rows == 0, tail(tmp_path / "run.log")
    _seed_inf(lake, "inf", 0, {0, 1, 2, 3})
    assert sum(r == math.inf for r in lake.read("trajectories", run_id="inf").column("reward").to_pylist()) == 4
    resumed = rlake(["resume", "inf", "--home", str(home)], cli_env(None), tmp_path / "resume.log")
    assert resumed.returncode == 0, tail(tmp_path / "resume.log")
    steps = lake.read("train_steps", run_id="inf").to_pylist()
    assert [s["iteration"] for s in steps] == [0]
    assert lake.get_run("inf")["status"] == "completed"
    assert "iteration 0: reusing its 16 samples already in the lake" in tail(tmp_path / "resume.log")


def crash_reward(cfg, sample):
    """custom_rm_path shape: the worker process dies on "exit", a value that cannot be sent back
    on "unsendable", prints (to the worker's stdout, which must not break the replies) else."""
    import os

    if sample.response == "exit":
        os._exit(3)
    if sample.response == "unsendable":
        return {"score": 1.0, "fn": lambda: 0}
    print("noise on stdout", flush=True)
    return 0.5


def test_reward_worker_crash_and_unsendable_value_fail_only_their_sample():
    scorer = Scorer(rm_type="exact", custom_rm_path="tests.test_rewards:crash_reward",
                    timeout_s=60.0, max_workers=2)
    try:
        samples = [_sample("exit"), _sample("unsendable"), *[_sample(str(i)) for i in range(4)]]
        assert score_samples(samples, scorer) == 2
        assert samples[0].reward_detail["error"] == "reward worker died (exit code 3)"
        assert samples[1].reward_detail["error"].startswith("reward value cannot be sent back")
        assert [s.reward for s in samples[2:]] == [0.5] * 4
        assert scorer.workers.replaced == 1
    finally:
        scorer.close()
    with pytest.raises(ValueError, match="custom_rm_path 'tests.test_rewards:nope' cannot be loaded"):
        Scorer(custom_rm_path="tests.test_rewards:nope")


def test_a_reward_worker_mid_call_dies_with_a_killed_run(tmp_path):
    """A kill -9 of the run left a busy-looping worker behind, reparented and spinning (its
    stdin's EOF is only read between calls): review, 2026-11-29."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    pid_file = tmp_path / "spin.pid"
    run = ("import sys\n"
           f"sys.path[:0] = {sys.path!r}\n"
           "from rewards.registry import Scorer, score_samples\n"
           "from tests.test_rewards import _sample\n"
           "scorer = Scorer(custom_rm_path='tests.test_rewards:spin_reward', timeout_s=600.0, max_workers=1)\n"
           f"score_samples([_sample('spin', pid_file={str(pid_file)!r})], scorer)\n")
    child = subprocess.Popen([sys.executable, "-c", run], cwd=Path(__file__).parents[1])
    spun = None
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() or not pid_file.read_text():
            assert child.poll() is None and time.monotonic() < deadline, "the reward never started"
            time.sleep(0.05)
        spun = int(pid_file.read_text())
        child.kill()
        child.wait()
        deadline = time.monotonic() + 5
        while _pid_alive(spun) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _pid_alive(spun), "the busy reward worker outlived the killed run"
    finally:
        if child.poll() is None:
            child.kill()
        if spun is not None and _pid_alive(spun):
            os.kill(spun, signal.SIGKILL)


def test_a_reward_worker_outlives_the_thread_that_started_it():
    """PR_SET_PDEATHSIG fires when the starting *thread* ends: a worker started by scoring on a
    step's thread must still serve the next batch."""
    scorer = Scorer(custom_rm_path="tests.test_rewards:spin_reward", timeout_s=60.0, max_workers=1)
    try:
        first = [_sample("a")]
        thread = threading.Thread(target=score_samples, args=(first, scorer))
        thread.start()
        thread.join()
        time.sleep(0.5)  # a SIGKILL from the thread's end would have landed
        again = [_sample("b")]
        assert score_samples(again, scorer) == 0
        assert again[0].reward_detail["pid"] == first[0].reward_detail["pid"]
        assert scorer.workers.replaced == 0
    finally:
        scorer.close()


def test_scorers_of_one_config_share_one_worker_pool():
    """The train reward and each eval set's Scorer had a pool each: 3 eval sets x 8 workers were
    32 processes (~7 GB) on 2 cores (review, 2026-11-29)."""
    from infra.config import load_config

    cfg = load_config(None, ["rollout.custom_rm_path=tests.test_rewards:spin_reward",
                             "rollout.reward_max_workers=2"])
    # eval sets without an rm_type of their own are scored by the run's custom reward
    train, *evals = [Scorer.from_config(cfg), Scorer.from_config(cfg), Scorer.from_config(cfg)]
    own = Scorer.from_config(cfg, rm_type="exact")  # one that names its own: no custom workers
    assert own.workers is None
    try:
        for scorer in (train, *evals):
            assert score_samples([_sample(str(i)) for i in range(4)], scorer) == 0
        assert all(e.workers is train.workers for e in evals)
        workers = train.workers.pids()
        assert 1 <= len(workers) <= 2
        other = Scorer.from_config(load_config(None, ["rollout.custom_rm_path=tests.test_rewards:spin_reward"]))
        assert other.workers is not train.workers  # another run's cfg: its own pool
    finally:
        for scorer in (train, *evals):  # as the run's close does: each scorer, the pool stops once
            scorer.close()
    assert not any(_pid_alive(p) for p in workers)
    assert Scorer.from_config(cfg).workers is not train.workers  # a closed pool is not handed out


def odd_dict_reward(cfg, sample):
    """custom_rm_path shape: a reward dict whose extra key or value JSON cannot hold."""
    if sample.response == "tuple key":
        return {"score": 1.0, (1, 2): "x"}
    if sample.response == "cycle":
        detail = {"score": 1.0}
        detail["self"] = detail
        return detail
    return {"score": 0.5, "arr": {1, 2}, 7: "int key"}  # str() of a set, "7": stored as before


def test_a_reward_dict_json_cannot_hold_fails_only_its_sample():
    """``{"score": 1.0, (1, 2): "x"}`` crashed the whole run at Sample.to_row ("keys must be
    str, int, float, bool or None, not tuple"): review, 2026-11-29."""
    scorer = Scorer(custom_rm_path="tests.test_rewards:odd_dict_reward", max_workers=1)
    try:
        samples = [_sample("tuple key"), _sample("cycle"), _sample("fine")]
        assert score_samples(samples, scorer) == 2
    finally:
        scorer.close()
    assert [s.status for s in samples] == [Status.FAILED, Status.FAILED, Status.PENDING]
    assert samples[0].reward_detail["error"] == ("ValueError: reward dict cannot be stored as JSON "
                                                 "(keys must be str, int, float, bool or None, not tuple)")
    assert samples[1].reward_detail["error"].startswith("ValueError: reward dict cannot be stored as JSON")
    rows = [s.to_row("r", 0, "torch") for s in samples]
    assert json.loads(rows[2]["reward_detail"]) == {"score": 0.5, "arr": "{1, 2}", "7": "int key"}


def test_countdown_takes_only_decimal_numbers():
    """Python also reads 0o11, 0x9, 0b1001 and 1_0 as ints: an answer scored 1.0 while
    "using" a 9 it never wrote (review, 2026-11-29)."""
    from rewards.tasks import countdown_reward

    meta = {"numbers": [1, 8, 9], "target": 72}
    assert countdown_reward("1*8*9", None, meta) == 1.0 == countdown_reward(" (9*8) / 1 ", None, meta)
    for hack in ("1*8*0o11", "0x1*8*9", "0b1*8*9", "1*8*9.0", "1*8*9e0"):
        assert countdown_reward(hack, None, meta) == 0.0, hack
    assert countdown_reward("1_0*5/2", None, {"numbers": [10, 5, 2], "target": 25}) == 0.0


def test_numpy_values_in_reward_detail_are_stored_as_numbers():
    """A ``{'score': np.float32(0.5), 'parts': np.array([...])}`` reward's detail went into the
    lake as the texts "0.5" and "[1 2]" (json's ``default=str``)."""
    import numpy as np

    from rollout.sample import detail_json

    detail = {"score": np.float32(0.5), "n": np.int64(3), "parts": np.array([1, 2]),
              "flag": np.bool_(True), "seen": {"a"}}
    assert json.loads(detail_json(detail)) == {"score": 0.5, "n": 3, "parts": [1, 2],
                                               "flag": True, "seen": "{'a'}"}
    sample = Sample(group_index=0, index=0, prompt="p", prompt_token_ids=[1], reward=0.5,
                    reward_detail=detail)
    row = sample.to_row("run", 0, "torch", "train")
    assert Sample.from_row(row).reward_detail["parts"] == [1, 2]
