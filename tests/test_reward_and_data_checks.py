"""What a reward may return, which samples it can score, and which prompt rows are refused at
load (review I, 2026-11-29): a null label scored an empty response 1.0, a chat prompt reached the
remote reward model as Python's repr, "0.7" / True / {"score": "1"} were coerced, 1e308 stopped
the run in the metrics' fsum, bad chat messages were loaded, and "acc nan" / "0% of eval set"
were shown."""

from __future__ import annotations

import io
import json
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from rewards.registry import Scorer, check_labels, score_samples
from rollout.data import load_prompt_file
from rollout.sample import MAX_ABS_REWARD, Sample, Status
from trainers.metrics import rollout_metrics

# custom rewards below run in worker processes, which import this module: its top imports are
# kept light (rich, torch come inside the tests that need them)
HERE = "tests.test_reward_and_data_checks"


def _write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _sample(response: str, label: str | None = None, prompt: str | list[dict] = "p",
            **metadata: object) -> Sample:
    return Sample(group_index=0, index=0, prompt=prompt, prompt_token_ids=[1], label=label,
                  response=response, metadata=dict(metadata))


# ----------------------------------------------------------------------------- bug 3: labels


@pytest.mark.parametrize("rm_type", ["exact", "addition", "f1", "math", "boxed_exact"])
def test_a_reward_comparing_with_the_label_fails_a_sample_without_one(tmp_path, rm_type):
    """The review's file: line 5 has ``"label": null``; exact and f1 scored an empty response
    1.0 against it (``label or ""``)."""
    path = _write_jsonl(tmp_path / "nullabel.jsonl", [{"prompt": "12+34=", "label": "46"}] * 4
                        + [{"prompt": "1+1=", "label": None}, {"prompt": "2+2=", "label": ""},
                           {"prompt": "3+3=", "label": " "}])
    records = load_prompt_file(str(path))
    boxed = rm_type.startswith("boxed_")
    right, empty = ("\\boxed{46}", "\\boxed{ }") if boxed else ("46", " ")
    samples = [_sample(right if r["label"] == "46" else empty, r["label"]) for r in records]
    samples[4].response = "no box" if boxed else samples[4].response  # 0 for no box hid it
    assert score_samples(samples, Scorer(rm_type=rm_type)) == 3
    assert [s.reward for s in samples[:4]] == [1.0] * 4
    name = rm_type.removeprefix("boxed_")
    for s, why in zip(samples[4:], ["null (missing)", "empty", "only whitespace"], strict=True):
        assert s.status == Status.FAILED and s.reward == 0.0
        assert s.reward_detail["error"] == f"ValueError: {name} reward needs a label: the label is {why}"


def test_rewards_that_need_no_label_still_score_unlabelled_rows():
    meta = {"numbers": [7, 4, 9], "target": 43}
    s = _sample("7+(4*9)", None, **meta)
    assert score_samples([s], Scorer(rm_type="countdown")) == 0 and s.reward == 1.0


def test_rows_without_a_label_are_refused_at_load_for_a_reward_that_needs_one(tmp_path):
    path = _write_jsonl(tmp_path / "n.jsonl", [{"prompt": f"{i}+{i}=", "label": str(2 * i)}
                                               for i in range(4)] + [{"prompt": "1+1=", "label": None}])
    records = load_prompt_file(str(path))
    with pytest.raises(ValueError, match=r"n.jsonl:line 5: the label is null \(missing\), but its "
                                         r"reward 'exact' compares the response with the label"):
        check_labels(records, str(path), "exact")
    with pytest.raises(ValueError, match=r"n.jsonl:line 5: .* reward 'math'"):
        check_labels(records, str(path), "boxed_math")
    check_labels(records, str(path), "countdown")  # needs none
    check_labels(records, str(path), "exact", custom_rm_path=f"{HERE}:typed_reward")  # its own say
    # the row's own rm_type is what scores it (as Scorer picks it)
    path = _write_jsonl(tmp_path / "m.jsonl", [
        {"prompt": "a", "label": None, "meta": {"rm_type": "countdown"}},
        {"prompt": "b", "label": "", "meta": {"rm_type": "f1"}}])
    records = load_prompt_file(str(path), metadata_key="meta")
    with pytest.raises(ValueError, match=r"m.jsonl:line 2: the label is empty, but its reward 'f1'"):
        check_labels(records, str(path), "countdown", custom_rm_path=f"{HERE}:typed_reward")
    # label_key: null under a labelled reward: the first row is named
    records = load_prompt_file(str(path), label_key=None)
    with pytest.raises(ValueError, match=r"m.jsonl:line 1: the label is null"):
        check_labels(records, str(path), "exact")


# ----------------------------------------------------------------------------- remote reward


class _Remote(BaseHTTPRequestHandler):
    """Records each body; replies with the JSON text named by the response (default 1)."""

    bodies: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server API
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        data = (body["response"] if body["response"].startswith("reply:") else "reply:1")[6:].encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def remote_url() -> Iterator[str]:
    _Remote.bodies = []
    with ThreadingHTTPServer(("127.0.0.1", 0), _Remote) as server:  # closed on leaving
        threading.Thread(target=server.serve_forever, daemon=True).start()
        yield f"http://127.0.0.1:{server.server_address[1]}/reward"
        server.shutdown()


def test_the_remote_reward_gets_a_chat_prompt_as_a_json_message_list(remote_url):
    chat = [{"role": "system", "content": "add"}, {"role": "user", "content": "33+19="}]
    samples = [_sample("52", "52", prompt=chat), _sample("52", "52", prompt="33+19=")]
    assert score_samples(samples, Scorer(rm_type="remote", rm_url=remote_url)) == 0
    prompts = sorted((b["prompt"] for b in _Remote.bodies), key=str)
    assert prompts == ["33+19=", chat]  # was "[{'role': 'system', ...}]", Python's repr


# ----------------------------------------------------------------------------- reward types


def typed_reward(cfg: object, sample: Sample) -> object:
    """custom_rm_path shape: returns the value the response names."""
    return {"str": "0.7", "bool": True, "none": None, "list": [1.0], "dict_str": {"score": "1"},
            "dict_bool": {"score": True}, "no_score": {"value": 1.0}, "np64": np.float64(0.5),
            "np32_dict": {"score": np.float32(0.25), "arr": np.arange(3)}, "int": 1,
            "huge": 1e308, "neg_huge": -1e200, "big_int": 10 ** 400, "bound": MAX_ABS_REWARD,
            }[sample.response]


def test_a_custom_reward_of_the_wrong_type_fails_naming_the_function_and_type():
    scorer = Scorer(rm_type="exact", custom_rm_path=f"{HERE}:typed_reward", max_workers=2)
    try:
        samples = [_sample(k) for k in ("str", "bool", "none", "list", "dict_str", "dict_bool",
                                        "no_score", "np64", "np32_dict", "int")]
        assert score_samples(samples, scorer) == 7
    finally:
        scorer.close()
    errors = {s.response: s.reward_detail.get("error") for s in samples}
    who, how = f"ValueError: custom reward {HERE}:typed_reward returned", "return a number or {'score': number}"
    assert errors["str"] == f"{who} str '0.7': {how}"
    assert errors["bool"] == f"{who} bool True: {how}"
    assert errors["none"] == f"{who} None: {how}"
    assert errors["list"] == f"{who} list [1.0]: {how}"
    assert errors["dict_str"] == f"{who} {{'score': str '1'}}: {how}"
    assert errors["dict_bool"] == f"{who} {{'score': bool True}}: {how}"
    assert errors["no_score"] == f"{who} a dict without 'score' (keys: ['value']): {how}"
    assert all(s.status == Status.FAILED and s.reward == 0.0 for s in samples[:7])
    assert [(s.reward, s.status) for s in samples[7:]] == [(0.5, Status.PENDING), (0.25, Status.PENDING),
                                                           (1.0, Status.PENDING)]


def test_a_plain_reward_function_gets_the_same_rule():
    s = _sample("x")
    assert score_samples([s], lambda r, lab, m: "0.7") == 1
    assert "returned str '0.7'" in s.reward_detail["error"]


def test_a_remote_reply_gets_the_same_rule(remote_url):
    replies = ['"0.5"', "true", '{"score": true}', '{"score": "0.7"}', "null", "[1]",
               '{"reward": 1}', "0.25"]
    samples = [_sample(f"reply:{r}") for r in replies]
    scorer = Scorer(rm_type="remote", rm_url=remote_url, remote_retries=0)
    assert score_samples(samples, scorer) == 6
    who = f"ValueError: remote reward {remote_url} returned"
    assert [s.reward_detail.get("error", "").removeprefix(who).split(":")[0] for s in samples[:6]] == [
        " str '0.5'", " bool True", " {'score'", " {'score'", " None", " list [1]"]
    assert samples[2].reward_detail["error"].startswith(f"{who} {{'score': bool True}}")
    assert [s.reward for s in samples[6:]] == [1.0, 0.25]


# ----------------------------------------------------------------------------- huge rewards


def test_a_reward_too_large_to_train_on_fails_its_sample():
    scorer = Scorer(rm_type="exact", custom_rm_path=f"{HERE}:typed_reward", max_workers=2)
    try:
        samples = [_sample(k) for k in ("huge", "neg_huge", "big_int", "bound")]
        assert score_samples(samples, scorer) == 3
    finally:
        scorer.close()
    assert samples[0].reward_detail["error"] == (
        "ValueError: reward 1e+308 too large: |reward| must be <= 1e+15 (rewards train as float32 "
        "and are squared in statistics)")
    assert samples[1].reward_detail["error"].startswith("ValueError: reward -1e+200 too large")
    assert samples[2].reward_detail["error"].startswith("ValueError: reward 1000000000")
    assert samples[3].reward == MAX_ABS_REWARD and samples[3].status == Status.PENDING


def test_rollout_metrics_of_huge_rewards_do_not_raise():
    """Rows an older lake holds (1e308 passed the NaN/inf check): "intermediate overflow in
    fsum" stopped the run, and its resume, naming nothing."""
    samples = [_sample("x") for _ in range(4)]
    for s, r in zip(samples, [1e308, 1e308, 1e308, -1e308], strict=True):
        s.reward = r
    stats = rollout_metrics(samples, 1.0)
    assert stats["rollout/reward_mean"] == pytest.approx(0.5e308)
    assert not math.isnan(stats["rollout/reward_std"])


# ----------------------------------------------------------------------------- chat messages


@pytest.mark.parametrize("message, problem", [
    ({"role": "user", "content": [{"type": "text", "text": "12+34="}]}, "has 'content' as a list"),
    ({"role": "user", "content": 1234}, "has 'content' int 1234: it must be a string"),
    ({"role": "user", "content": ""}, "has empty 'content'"),
    ({"role": "user", "content": " \n"}, "has 'content' of only whitespace"),
    ({"content": "12+34="}, "has no 'role'"),
    ({"role": "", "content": "12+34="}, "has 'role' '': it must be a non-empty string"),
    ({"role": 5, "content": "12+34="}, "has 'role' 5: it must be a non-empty string"),
    ({"role": "user"}, "has no 'content'"),
])
def test_a_bad_chat_message_is_refused_at_load_naming_file_line_and_problem(tmp_path, message, problem):
    good = [{"role": "user", "content": "1+1="}]
    path = _write_jsonl(tmp_path / "c.jsonl", [{"prompt": good, "label": "2"},
                                               {"prompt": [good[0], message], "label": "46"}])
    with pytest.raises(ValueError) as err:
        load_prompt_file(str(path))
    assert str(err.value).startswith(f"{path}:line 2: 'prompt' is a list, so each item must be a message")
    assert f"message 2 {problem}" in str(err.value)


def test_a_tool_call_message_may_have_no_content(tmp_path):
    chat = [{"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": None, "tool_calls": [{"name": "calc"}]},
            {"role": "assistant", "content": "", "tool_calls": [{"name": "calc"}]},
            {"role": "tool", "content": "4"}]
    path = _write_jsonl(tmp_path / "t.jsonl", [{"prompt": chat, "label": "4"}])
    assert load_prompt_file(str(path))[0]["prompt"] == chat


# ----------------------------------------------------------------------------- what is shown


def test_the_progress_line_shows_none_for_an_eval_whose_rewards_all_failed():
    from rich.console import Console

    from infra.progress import RichReporter

    console = Console(file=io.StringIO(), width=200)
    reporter = RichReporter(console)
    reporter("rl_start", {"total": 3, "start": 0})
    reporter("iteration", {"iteration": 0, "eval/accuracy": math.nan, "rollout/reward_mean": 0.0,
                           "time/total": 1.0})
    info = reporter.progress.tasks[0].fields["info"]
    assert "acc none" in info and "nan" not in info
    assert "held-out accuracy none (its rewards failed)" in console.file.getvalue()
    reporter("iteration", {"iteration": 1, "eval/accuracy": 0.25, "rollout/reward_mean": 0.0,
                           "time/total": 1.0})
    assert "acc 0.250" in reporter.progress.tasks[0].fields["info"]


def test_the_eval_warning_counts_a_few_failures_instead_of_rounding_to_zero():
    from tasks.eval import failed_share  # imports torch: not at the top (reward workers import us)

    samples = [_sample("x") for _ in range(500)]
    for s in samples[:2]:
        s.status = Status.FAILED
    assert failed_share(samples) == "2/500 (0.4%)"  # was "0%"
    for s in samples:
        s.status = Status.FAILED
    assert failed_share(samples) == "100%"


def test_a_stored_reward_too_large_to_train_on_reads_back_failed_and_trains_as_zero():
    """A lake written before the bound: its 1e308 reward is a failed sample and trains as 0.0."""
    from rollout.sample import Sample, Status, train_reward

    row = {"group_index": 0, "sample_index": 0, "prompt": "1+1=", "prompt_token_ids": [1, 2],
           "reward": 1e308, "status": "completed"}
    sample = Sample.from_row(row)
    assert sample.status == Status.FAILED and sample.reward == 0.0
    assert "too large" in sample.reward_detail["error"]
    assert train_reward(1e308) == 0.0 and train_reward(-MAX_ABS_REWARD) == -MAX_ABS_REWARD


def test_an_eval_sets_own_rm_type_scores_it_in_a_run_with_a_custom_reward():
    """``custom_rm_path`` is the run's reward; an eval set that names its own (``rm_type``) is
    scored by that one (the custom one took it over)."""
    from infra.config import load_config
    from tests.opshelp import ROOT

    cfg = load_config(ROOT / "configs" / "quickstart.yaml",
                      [f"rollout.custom_rm_path={HERE}:typed_reward"])
    eval_scorer = Scorer.from_config(cfg, rm_type="exact")
    assert eval_scorer(_sample("42", "42")) == 1.0 and eval_scorer(_sample("41", "42")) == 0.0
    run_scorer = Scorer.from_config(cfg)  # the run's own: the custom function
    assert run_scorer.reward_name(_sample("int")) == f"custom reward {HERE}:typed_reward"
