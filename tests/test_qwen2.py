"""rlake's own Qwen2 (infra/qwen2.py) against transformers' on CPU: the same logits and
gradients bit for bit, the same KV-cache continuation, HF folders written and read both ways
(that a run's loading imports no transformers: tests/test_tokenizer_cache.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from infra import qwen2
from infra.config import TinyModelConfig
from infra.modeling import build_tiny_model, load_model, own_model_config

torch.set_num_threads(1)

# two layers, 4 query heads over 2 KV heads (grouped), odd sizes so no shape coincides
SHAPE = TinyModelConfig(num_hidden_layers=2, hidden_size=48, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=80, max_position_embeddings=32)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("qwen2") / "tiny", SHAPE, seed=3))


def hf_model(path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").train()


def padded_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [6, 9] right-padded with the pad token (0) and their mask (lengths 9 down to 4)."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(9)[None] < torch.tensor([9, 8, 7, 6, 5, 4])[:, None]).long()
    return torch.randint(4, 40, (6, 9), generator=g) * mask, mask


def test_load_model_gives_rlakes_qwen2_on_cpu(folder):
    assert isinstance(load_model(folder), qwen2.Qwen2ForCausalLM)


def test_logits_and_gradients_equal_transformers_bit_for_bit(folder):
    ids, mask = padded_batch()
    ours, theirs = load_model(folder).train(), hf_model(folder)
    assert sorted(ours.state_dict()) == sorted(theirs.state_dict())
    assert ours.model.embed_tokens.padding_idx == theirs.model.embed_tokens.padding_idx == 0
    a = ours(input_ids=ids, attention_mask=mask).logits
    b = theirs(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(a, b)
    # a loss over real positions only, weighted per position so every gradient path is used
    weights = torch.linspace(0.5, 2.0, a.shape[-1])
    (a.log_softmax(-1) * weights * mask[..., None]).sum().backward()
    (b.log_softmax(-1) * weights * mask[..., None]).sum().backward()
    ours_p, theirs_p = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert sorted(ours_p) == sorted(theirs_p)
    for name, p in ours_p.items():
        assert torch.equal(p.grad, theirs_p[name].grad), name


def test_a_cached_prefix_reordered_then_continued_equals_transformers(folder):
    """The shared-prompt forward's use of the cache: prompts once, rows re-indexed, responses
    attending to [prompt keys ; their own] with explicit positions."""
    ids, mask = padded_batch(seed=1)
    ours, theirs = load_model(folder).train(), hf_model(folder)
    rows = torch.tensor([0, 0, 1, 3, 3, 2])
    positions = torch.arange(4, 9)[None].expand(6, -1)
    outputs = []
    for model, cache in ((ours.model, ours.model.new_cache()),
                         (theirs.model, DynamicCache(config=theirs.config))):
        first = model(input_ids=ids[:4, :4], attention_mask=mask[:4, :4], past_key_values=cache,
                      use_cache=True).last_hidden_state
        cache.reorder_cache(rows)
        rest = model(input_ids=ids[:, 4:], attention_mask=mask, position_ids=positions,
                     past_key_values=cache, use_cache=True).last_hidden_state
        outputs.append((first, rest))
    assert torch.equal(outputs[0][0], outputs[1][0])
    assert torch.equal(outputs[0][1], outputs[1][1])


def test_activation_checkpointing_gives_the_same_gradients(folder):
    ids, mask = padded_batch(seed=2)
    grads = []
    for checkpointing in (False, True):
        model = load_model(folder).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        model(input_ids=ids, attention_mask=mask).logits.logsumexp(-1).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_save_pretrained_is_an_hf_folder_transformers_loads(folder, tmp_path):
    ours = load_model(folder)
    with torch.no_grad():
        ours.model.norm.weight.add_(0.25)  # a change, so the folder is not the source
    ours.save_pretrained(tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors"]
    assert qwen2.read_config(tmp_path / "out") == qwen2.read_config(folder)
    theirs = hf_model(str(tmp_path / "out"))
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, theirs.state_dict()[name]), name
    # tied: one tensor for embedding and head, as transformers ties them
    reloaded = load_model(tmp_path / "out")
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight


def test_other_models_and_cuda_stay_on_transformers(folder, tmp_path):
    raw = qwen2.read_config(folder)
    assert qwen2.supports(raw)
    assert not qwen2.supports(raw | {"use_sliding_window": True})
    assert not qwen2.supports(raw | {"model_type": "llama"})
    assert not qwen2.supports(raw | {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    assert not qwen2.supports(raw | {"layer_types": ["full_attention", "sliding_attention"]})
    # RoPE over part of each head, or scaled under the older key: transformers computes it, this
    # module would compute plain RoPE over the whole head (a model other than the checkpoint's)
    assert not qwen2.supports(raw | {"partial_rotary_factor": 0.5})
    assert not qwen2.supports(raw | {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                         "partial_rotary_factor": 0.5}})
    assert not qwen2.supports({k: v for k, v in raw.items() if k != "rope_parameters"}
                              | {"rope_scaling": {"type": "linear", "factor": 2.0}})
    other = tmp_path / "sliding"
    other.mkdir()
    for f in ("model.safetensors", "generation_config.json"):
        (other / f).write_bytes((Path(folder) / f).read_bytes())
    (other / "config.json").write_text(json.dumps(raw | {"model_type": "llama"}))
    assert not isinstance(load_model(other), qwen2.Qwen2ForCausalLM)
    assert own_model_config(folder, "cpu") == raw
    assert own_model_config(folder, "cuda") is None  # CUDA: transformers' SDPA path
