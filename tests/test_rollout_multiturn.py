"""Multi-turn tool use: mask assembly on fixed token lists, and the calculator loop with the real
TorchEngine on a tiny model (structure, mask, log-probs, tool outputs, lake round trip)."""

from __future__ import annotations

import pytest
import torch

from buffer import Lake
from examples.calculator_tool.generate import calculator, tool_call
from infra.config import TinyModelConfig, load_config
from infra.modeling import build_tiny_model, load_tokenizer
from rollout.context import RolloutContext
from rollout.data import PromptDataset
from rollout.engine import SamplingParams
from rollout.multiturn import assemble_turns, model_turn, split_by_mask, tool_turn
from rollout.runner import Rollout
from rollout.sample import Sample, Status
from rollout.torch_engine import TorchEngine

torch.set_num_threads(1)


def test_assemble_turns_on_fixed_lists():
    turns = [model_turn([5, 6, 7], [-0.1, -0.2, -0.3]), tool_turn([40, 41]),
             model_turn([8], [-0.4]), tool_turn([]), model_turn([2], [-0.5])]
    ids, logprobs, mask = assemble_turns(turns)
    assert ids == [5, 6, 7, 40, 41, 8, 2]
    assert mask == [1, 1, 1, 0, 0, 1, 1]
    assert logprobs == [-0.1, -0.2, -0.3, 0.0, 0.0, -0.4, -0.5]
    assert split_by_mask(ids, mask) == [(1, [5, 6, 7]), (0, [40, 41]), (1, [8, 2])]
    with pytest.raises(ValueError, match="2 tokens but 1 log-probs"):
        model_turn([1, 2], [-0.1])


def test_calculator_and_call_parsing():
    assert calculator("12*7") == "84" and calculator("1/3") == "0.3333" and calculator("7/2") == "3.5"
    assert calculator("2**9") == "err" and calculator("a+1") == "err" and calculator("1/0") == "err"
    assert tool_call("so [3+4]") == "3+4" and tool_call("3+4]") is None and tool_call("[3") is None


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64), seed=0)
    tok = load_tokenizer(path)
    cfg = load_config(None, ["rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
                             "rollout.rm_type=math", "rollout.custom_generate_function_path="
                             "examples.calculator_tool.generate:generate"])
    engine = TorchEngine(str(path), tok.eos_token_id, tok.pad_token_id, seed=0)
    records = [{"prompt": f"{a}*7+5=", "label": str(a * 7 + 5), "metadata": {}} for a in range(10, 20)]
    return RolloutContext(cfg=cfg, engine=engine, tokenizer=tok, dataset=PromptDataset(records),
                          scorer=None, sampling=SamplingParams(max_new_tokens=40), lake=None,
                          run_id="mt")


def test_calculator_loop_with_the_real_engine(ctx, tmp_path):
    tok = ctx.tokenizer
    close_id, open_id = tok.convert_tokens_to_ids("]"), tok.convert_tokens_to_ids("[")
    out = Rollout(ctx.cfg)(ctx, 0)
    samples = out.samples
    assert len(samples) == 16 and all(s.status in (Status.COMPLETED, Status.TRUNCATED) for s in samples)
    calls = continued = 0
    for s in samples:
        n = s.response_length
        assert len(s.loss_mask) == n == len(s.rollout_log_probs) and n <= 40
        runs = split_by_mask(s.response_token_ids, s.loss_mask)
        assert runs[0][0] == 1  # the model speaks first
        for i, (m, toks) in enumerate(runs):
            if m == 0:  # a tool output: the model's preceding turn ended with a call "[expr]"
                model_text = tok.decode(runs[i - 1][1])
                assert runs[i - 1][1][-1] == close_id and open_id in runs[i - 1][1]
                assert tok.decode(toks) == calculator(tool_call(model_text))[:len(toks)]
                calls += 1
                continued += i + 1 < len(runs)  # generation went on after the tool
        pos = 0
        for m, toks in runs:
            lp = s.rollout_log_probs[pos:pos + len(toks)]
            assert all(x == 0.0 for x in lp) if m == 0 else all(x < 0.0 for x in lp)
            pos += len(toks)
        assert s.metadata["tool_calls"] == sum(m == 0 for m, _ in runs)
        assert s.response == tok.decode(s.response_token_ids, skip_special_tokens=True)
    assert calls >= 1 and continued >= 1
    lake = Lake(str(tmp_path / "lake"))
    lake.append_trajectories(out.rows("mt", 0, "torch", partial_rollout=False))
    back = [Sample.from_row(r) for r in lake.read("trajectories", run_id="mt").to_pylist()]
    back.sort(key=lambda s: s.index)
    assert [(b.response_token_ids, b.loss_mask) for b in back] == [
        (s.response_token_ids, s.loss_mask) for s in samples]
