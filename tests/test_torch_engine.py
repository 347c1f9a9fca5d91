"""The embedded torch engine: correct sampling, log-probs that match the HF model, stopping."""

from __future__ import annotations

import pytest
import torch

from infra.config import TinyModelConfig
from infra.modeling import build_tiny_model, load_model, load_tokenizer
from rollout.engine import SamplingParams
from rollout.fast_decoder import FastDecoder
from rollout.torch_engine import TorchEngine, prompt_runs, run_starts, sample_next_token


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelConfig(max_position_embeddings=128), seed=3)
    return path, load_tokenizer(path)


def hf_logprobs(model, prompt: list[int], response: list[int], temperature: float = 1.0) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0] / temperature
    logp = torch.log_softmax(logits, -1)
    return [logp[len(prompt) - 1 + t, tok].item() for t, tok in enumerate(response)]


def test_sampling_matches_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    gen = torch.Generator().manual_seed(0)
    tokens, logp = sample_next_token(logits, 1.0, 1.0, -1, gen)
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    expected = torch.softmax(logits[0], -1)
    assert torch.allclose(freq, expected, atol=0.015), (freq, expected)
    assert torch.allclose(logp, torch.log(expected)[tokens], atol=1e-6)


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]]).repeat(2000, 1)
    gen = torch.Generator().manual_seed(1)
    assert set(sample_next_token(logits, 1.0, 1.0, 2, gen)[0].tolist()) == {0, 1}
    # p(0) ~ 0.64, p(0)+p(1) ~ 0.88: top_p = 0.7 keeps the first two
    assert set(sample_next_token(logits, 1.0, 0.7, -1, gen)[0].tolist()) == {0, 1}
    greedy, _ = sample_next_token(logits, 0.0, 1.0, -1, gen)
    assert greedy.eq(0).all()


def test_fast_decoder_logits_equal_hf(tiny):
    path, tok = tiny
    model = load_model(path)
    fast = FastDecoder(model)
    ids = torch.tensor([[1, 7, 8, 14, 9, 12, 18]])
    cache = fast.new_cache(1, 16)
    logits = fast.forward(ids, torch.arange(7)[None], torch.ones(1, 16, dtype=torch.bool), cache, 0)
    with torch.no_grad():
        ref = model(ids).logits[0, -1]
    assert torch.allclose(logits[0], ref, atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_match_hf_recomputation_with_left_padding(tiny, temperature):
    path, tok = tiny
    engine = TorchEngine(str(path), eos_token_id=-1, pad_token_id=tok.pad_token_id, seed=0)
    prompts = [[tok.bos_token_id, *tok(p, add_special_tokens=False)["input_ids"]]
               for p in ["37+48=", "5+6=", "123+4="]]
    results = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=temperature))
    model = load_model(path)
    for prompt, res in zip(prompts, results, strict=True):
        assert len(res.token_ids) == len(res.logprobs) == 12
        assert res.finish_reason == "length"
        ref = hf_logprobs(model, prompt, res.token_ids, temperature)
        assert max(abs(a - b) for a, b in zip(ref, res.logprobs, strict=True)) < 1e-5


def test_engine_stops_at_eos_and_reports_it(tiny):
    path, tok = tiny
    engine = TorchEngine(str(path), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = engine.model
    with torch.no_grad():  # make EOS the only likely token
        model.lm_head.weight.data[tok.eos_token_id] *= 0
        model.model.embed_tokens.weight.data[tok.eos_token_id] += 50 * model.model.norm.weight.data.sign()
    engine.load_state_dict(model.state_dict(), weight_version=7)
    out = engine.generate([[tok.bos_token_id, 7, 8]], SamplingParams(max_new_tokens=5, temperature=0.0))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == tok.eos_token_id
    assert engine.weight_version == 7


def test_same_seed_same_samples(tiny):
    path, tok = tiny
    prompts = [[tok.bos_token_id, 7, 8, 14]] * 4
    sp = SamplingParams(max_new_tokens=8, temperature=1.0, seed=123)
    a = TorchEngine(str(path), -1, tok.pad_token_id).generate(prompts, sp)
    b = TorchEngine(str(path), -1, tok.pad_token_id).generate(prompts, sp)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


def test_prompt_runs_group_consecutive_equal_prompts():
    a, b = [1, 5, 6], [1, 5]
    assert prompt_runs([a, a, b, b, b, a]) == [0, 0, 1, 1, 1, 2]
    assert run_starts([0, 0, 1, 1, 1, 2]) == [0, 2, 5]
    assert prompt_runs([a, b, a]) is None  # nothing to share


@pytest.mark.parametrize("hf_step", [False, True])
def test_shared_prefill_gives_every_sample_its_own_correct_logprobs(tiny, hf_step):
    """Groups of equal prompts (of different lengths) are prefilled once and then sampled row by
    row: each row's tokens differ from its group mates' and its log-probs are the HF model's.
    ``hf_step``: the same through HF's forward (models the fast decoder does not cover)."""
    path, tok = tiny
    engine = TorchEngine(str(path), eos_token_id=-1, pad_token_id=tok.pad_token_id, seed=0)
    if hf_step:
        engine.fast = None
    groups = [[tok.bos_token_id, *tok(p, add_special_tokens=False)["input_ids"]]
              for p in ["37+48=", "5+6=", "123+4="]]
    prompts = [p for p in groups for _ in range(4)]
    prefill_rows = []
    if not hf_step:
        forward = engine.fast.forward
        engine.fast.forward = lambda ids, *a: prefill_rows.append(ids.shape) or forward(ids, *a)
    results = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=1.0))
    if not hf_step:
        assert prefill_rows[0] == (3, len(groups[2]))  # one row per distinct prompt
        assert all(shape == (12, 1) for shape in prefill_rows[1:])
    model = load_model(path)
    for prompt, res in zip(prompts, results, strict=True):
        ref = hf_logprobs(model, prompt, res.token_ids)
        assert max(abs(a - b) for a, b in zip(ref, res.logprobs, strict=True)) < 1e-5
    for g in range(3):
        assert len({tuple(r.token_ids) for r in results[4 * g:4 * g + 4]}) > 1
