"""Reward registry, math/f1/exact/countdown verifiers, failure handling, remote reward model."""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rewards.concurrent import run_concurrently
from rewards.math import answers_equal, extract_answer, last_boxed, normalize_answer
from rewards.registry import Scorer, get_reward_fn, score_samples
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
    samples = [_sample("1", "1"), _sample("2", "2"), _sample("3", "3")]
    fns = {"1": lambda r, lab, m: 1.0, "2": _raises, "3": _nan}
    failed = score_samples(samples, lambda r, lab, m: fns[r](r, lab, m))
    assert failed == 2
    assert samples[0].reward == 1.0 and samples[0].status == Status.PENDING
    assert samples[1].status == Status.FAILED and "KeyError" in samples[1].reward_detail["error"]
    assert "NaN" in samples[2].reward_detail["error"] and samples[2].reward == 0.0


def test_hung_reward_times_out_and_others_still_score():
    samples = [_sample("hang"), *[_sample(str(i), str(i)) for i in range(5)]]
    fn = lambda r, lab, m: _hangs(r, lab, m) if r == "hang" else 1.0  # noqa: E731
    failed = score_samples(samples, fn, timeout_s=0.3, max_workers=1)  # the hung call holds the only slot
    assert failed == 1
    assert samples[0].reward_detail["error"] == "timed out after 0.3s"
    assert [s.reward for s in samples[1:]] == [1.0] * 5


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
