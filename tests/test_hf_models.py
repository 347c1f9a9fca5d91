"""Architectures beyond the tiny Qwen2: the engine and the trainer must be the policy that
transformers' own forward computes (log-probs, stop ids), and non-causal models are refused.

Each model is a tiny random HF model built offline (hidden 32, 2 layers, vocabulary 64, seeded),
saved to a folder and loaded as a run loads it; the reference is transformers' forward/generate.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    BertConfig,
    BertForMaskedLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

from infra.config import ConfigError, load_config
from infra.modeling import build_char_tokenizer, load_model
from rollout.engine import SamplingParams
from rollout.fast_decoder import supports
from rollout.torch_engine import TorchEngine
from trainers.base import TrainBatch, pad_batch
from trainers.torch_trainer import response_logprobs

VOCAB = 64
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)
# prompts of different lengths (left padding in the engine), longer than a 4-token window
PROMPTS = [[1, 7, 8, 14, 9, 12, 18, 5], [1, 30, 31], [1, 40, 41, 42, 43, 44], [1, 9, 9, 9, 9]]


def save_model(folder, model_cls, config, seed: int = 0, scale_head: float = 1.0,
               bias_std: float = 0.0):
    """A random fp32 model of ``config`` saved at ``folder``: output head weights scaled by
    ``scale_head`` (large logits, so a logit transform shows), biases drawn with ``bias_std``
    (HF initialises them to zero, which would hide a missing bias)."""
    torch.manual_seed(seed)
    model = model_cls(config).float()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(scale_head)
        for name, param in model.named_parameters():
            if bias_std and name.endswith(".bias"):
                param.normal_(0.0, bias_std)
    model.save_pretrained(folder)
    return folder


def hf_reference(path):
    """transformers' own model for the folder (eager attention, eval mode)."""
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                attn_implementation="eager").eval()


def hf_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log softmax of transformers' logits at each response token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


# --- 2: generation_config.json's eos ids stop the torch engine --------------------------------


def test_engine_stops_on_every_generation_config_eos(tmp_path):
    """A chat model's end-of-turn id listed in generation_config.json (``eos_token_id: [2, X]``,
    Qwen2.5/Llama-3-Instruct) ends the response as transformers' generate ends it, with finish
    reason ``stop``; the engine is built as a run builds it (``_make_engine``)."""
    from infra.runtime import _make_engine

    tok = build_char_tokenizer()
    path = save_model(tmp_path / "m", LlamaForCausalLM,
                      LlamaConfig(**{**SHAPE, "vocab_size": len(tok)}), seed=1)
    hf = hf_reference(path)
    prompt = PROMPTS[0]
    first = int(hf(torch.tensor([prompt])).logits[0, -1].argmax())
    assert first != tok.eos_token_id
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(
        json.dumps({**gen, "eos_token_id": [tok.eos_token_id, first]}))
    hf = hf_reference(path)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                       pad_token_id=tok.pad_token_id)[0, len(prompt):].tolist()
    assert want == [first]
    cfg = load_config(None).model_copy(update={"device": "cpu", "dtype": "fp32"})
    engine = _make_engine(cfg, path, tok, 0)
    sp = SamplingParams(max_new_tokens=6, temperature=0.0)
    greedy = engine.generate([prompt, prompt[:3]], sp)
    assert greedy[0].token_ids == want and greedy[0].finish_reason == "stop"
    # the tokenizer's eos still stops too; a -1 given alone still never stops
    assert tok.eos_token_id in engine.eos_token_ids
    engine.eos_token_id = -1
    assert engine.generate([prompt], sp)[0].finish_reason == "length"


# --- 3: the trainer applies the model's output-logit transform ---------------------------------


@pytest.mark.parametrize("name", ["gemma2_softcap", "granite_logits_scaling"])
def test_trainer_logprobs_equal_hf_with_logit_transform(tmp_path, name):
    """Gemma2's ``final_logit_softcapping`` and Granite's ``logits_scaling`` are part of the
    policy: the trainer's log-probs (whole and vocabulary-chunked) equal transformers'."""
    if name == "gemma2_softcap":
        config = Gemma2Config(**SHAPE, head_dim=8, final_logit_softcapping=2.0, sliding_window=16)
        path = save_model(tmp_path / name, Gemma2ForCausalLM, config, scale_head=30.0)
    else:
        config = GraniteConfig(**SHAPE, logits_scaling=8.0)
        path = save_model(tmp_path / name, GraniteForCausalLM, config)
    hf = hf_reference(path)
    responses = [[5 + i, 20 + i, 33, 2] for i in range(len(PROMPTS))]
    batch = TrainBatch(sample_uids=[str(i) for i in range(len(PROMPTS))], prompt_token_ids=PROMPTS,
                       response_token_ids=responses, loss_mask=[[] for _ in PROMPTS],
                       rollout_logprobs=[[0.0] * 4 for _ in PROMPTS], rewards=[0.0] * len(PROMPTS),
                       group_keys=[str(i) for i in range(len(PROMPTS))],
                       weight_versions=[0] * len(PROMPTS))
    pb = pad_batch(batch, 0)
    want = torch.stack([hf_logprobs(hf, p, r) for p, r in zip(PROMPTS, responses, strict=True)])
    model = load_model(path).train()
    for chunk in (None, 16):
        with torch.no_grad():
            got, _ = response_logprobs(model, pb, 1.0, vocab_chunk_size=chunk)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


# --- 4: the fast decoder only serves what it computes as HF does -------------------------------


def engine_vs_hf(path) -> float:
    """max |engine log-prob - transformers' log-prob| over sampled responses to PROMPTS."""
    engine = TorchEngine(str(path), -1, 0, seed=0)
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.0))
    hf = hf_reference(path)
    return max((hf_logprobs(hf, p, r.token_ids) - torch.tensor(r.logprobs)).abs().max().item()
               for p, r in zip(PROMPTS, results, strict=True))


@pytest.mark.parametrize("name", ["qwen2_sliding_window", "llama_o_proj_and_mlp_bias", "llama"])
def test_engine_logprobs_equal_hf(tmp_path, name):
    """Qwen2 with a sliding window that applies, and Llama with o_proj/MLP biases, sample
    with transformers' log-probs (the fast decoder computes neither: they take HF's path); a
    plain Llama keeps the fast decoder and matches too."""
    if name == "qwen2_sliding_window":
        config = Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=4,
                             max_window_layers=0)
        path = save_model(tmp_path / name, Qwen2ForCausalLM, config, scale_head=20.0)
    elif name == "llama_o_proj_and_mlp_bias":
        config = LlamaConfig(**SHAPE, attention_bias=True, mlp_bias=True)
        path = save_model(tmp_path / name, LlamaForCausalLM, config, scale_head=20.0, bias_std=0.5)
    else:
        path = save_model(tmp_path / name, LlamaForCausalLM, LlamaConfig(**SHAPE), scale_head=20.0)
        assert TorchEngine(str(path), -1, 0).fast is not None
    assert engine_vs_hf(path) < 1e-4


def test_fast_decoder_supports_only_what_it_computes():
    """Config features the fast decoder does not implement send the model to HF's path; a
    window that applies to no layer (max_window_layers >= layers) does not."""
    base = dict(SHAPE)
    assert supports(Qwen2Config(**base)) and supports(LlamaConfig(**base))
    assert supports(Qwen2Config(**base, use_sliding_window=True, sliding_window=4,
                                max_window_layers=2))
    refused = [
        Qwen2Config(**base, use_sliding_window=True, sliding_window=4, max_window_layers=1),
        Qwen2Config(**base, layer_types=["full_attention", "sliding_attention"], sliding_window=4),
        LlamaConfig(**base, attention_bias=True),
        LlamaConfig(**base, mlp_bias=True),
        LlamaConfig(**base, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                             "rope_theta": 10000.0}),
        LlamaConfig(**base, hidden_act="gelu"),
    ]
    assert not any(supports(c) for c in refused)


# --- 9: a model that is not a decoder-only causal LM is refused at load ------------------------


@pytest.mark.parametrize("name", ["bert_not_decoder", "t5_encoder_decoder"])
def test_non_causal_model_refused_at_load(tmp_path, name):
    """BERT with ``is_decoder: false`` (bidirectional) and T5 (encoder-decoder) are refused in
    one line that names model.path and what is supported."""
    if name == "bert_not_decoder":
        config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                            num_attention_heads=2, intermediate_size=64, pad_token_id=0)
        path = save_model(tmp_path / name, BertForMaskedLM, config)
    else:
        config = T5Config(vocab_size=VOCAB, d_model=32, d_ff=64, num_layers=1, num_heads=2,
                          d_kv=16, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
        path = save_model(tmp_path / name, T5ForConditionalGeneration, config)
    with pytest.raises(ConfigError) as err:
        load_model(path)
    message = str(err.value)
    assert "\n" not in message and f"model.path '{path}'" in message
    assert "decoder-only causal LM" in message
