"""HF Qwen2/Llama <-> megatron GPTModel weight mapping: logits agree, round trips are exact."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from trainers.megatron.cpu_patches import apply_cpu_patches
from trainers.megatron.model import (
    build_gpt_model,
    forward_logits,
    init_distributed,
    process_group_backend,
)
from trainers.megatron.weight_mapping import (
    ModelShape,
    fuse_qkv,
    hf_to_megatron,
    megatron_to_hf,
    split_qkv,
)

pytestmark = pytest.mark.megatron
torch.set_num_threads(1)

SIZES = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=32, max_position_embeddings=64,
             rope_theta=5000.0)


@pytest.fixture(scope="module", autouse=True)
def megatron_world():
    init_distributed(1, 1)
    patches = apply_cpu_patches()
    yield
    patches.undo()


def tiny_hf(kind: str, tie: bool, seed: int = 0):
    torch.manual_seed(seed)
    if kind == "qwen2":
        cfg = Qwen2Config(**SIZES, tie_word_embeddings=tie)
        model = Qwen2ForCausalLM(cfg)
    else:
        cfg = LlamaConfig(**SIZES, tie_word_embeddings=tie)
        model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # random, non-trivial norms and biases so every weight matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model.float().eval()


def hf_weights(model) -> dict[str, torch.Tensor]:
    sd = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def test_process_group_backend_is_nccl_on_gpu_and_gloo_on_cpu():
    assert process_group_backend(cuda_available=True) == "nccl"
    assert process_group_backend(cuda_available=False) == "gloo"
    # the world of one this module runs in (init_distributed) chose by the same rule
    assert torch.distributed.get_backend() == process_group_backend(torch.cuda.is_available())


def device_of(model) -> torch.device:
    return next(model.parameters()).device


CASES = [("qwen2", True), ("qwen2", False), ("llama", True), ("llama", False)]


@pytest.mark.parametrize("kind,tie", CASES)
def test_hf_to_megatron_logits_and_round_trip(kind, tie):
    hf = tiny_hf(kind, tie)
    shape = ModelShape.from_hf_config(hf.config)
    assert shape.rope_theta == 5000.0 and shape.qkv_bias == (kind == "qwen2")
    mg = build_gpt_model(shape).eval()
    missing, unexpected = mg.load_state_dict(hf_to_megatron(hf_weights(hf), shape), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing)
    ids = torch.randint(0, shape.vocab_size, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        got = forward_logits(mg, ids.to(device_of(mg))).cpu()  # megatron is on the GPU if any
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    back = megatron_to_hf([mg.state_dict()], shape)
    want = hf_weights(hf)
    assert back.keys() == want.keys()
    for k in want:
        assert torch.equal(back[k].cpu(), want[k]), k


@pytest.mark.parametrize("kind,tie", CASES)
def test_megatron_to_hf_logits(kind, tie):
    """The other direction: a megatron model (its own random init) exported to HF."""
    hf = tiny_hf(kind, tie)
    shape = ModelShape.from_hf_config(hf.config)
    torch.manual_seed(7)
    mg = build_gpt_model(shape).eval()
    with torch.no_grad():
        for name, p in mg.named_parameters():
            if "layernorm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    exported = megatron_to_hf([mg.state_dict()], shape)
    fresh = tiny_hf(kind, tie, seed=3)
    missing, unexpected = fresh.load_state_dict(exported, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    if tie:
        assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, shape.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids).logits,
                                   forward_logits(mg, ids.to(device_of(mg))).cpu(),
                                   atol=1e-5, rtol=0)
    again = hf_to_megatron(exported, shape)
    own = {k: v for k, v in mg.state_dict().items() if not k.endswith("_extra_state")}
    assert again.keys() == own.keys()
    assert all(torch.equal(again[k], own[k]) for k in own)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("kind,tie", [("qwen2", False), ("llama", True)])
def test_tp_shards_merge_back_exactly(kind, tie, tp):
    """Sharding for TP rank r of N and merging the N shards gives the HF weights back; each
    QKV shard holds whole query groups."""
    cfg = dict(SIZES, num_attention_heads=8, num_key_value_heads=4, vocab_size=30)
    hf = (Qwen2ForCausalLM(Qwen2Config(**cfg, tie_word_embeddings=tie)) if kind == "qwen2"
          else LlamaForCausalLM(LlamaConfig(**cfg, tie_word_embeddings=tie)))
    shape = ModelShape.from_hf_config(hf.config)
    want = hf_weights(hf)
    shards = [hf_to_megatron(want, shape, r, tp) for r in range(tp)]
    # vocab 30 padded to ceil(30 / tp) * tp rows, split evenly: the HF rows, then zero rows
    embs = [s["embedding.word_embeddings.weight"] for s in shards]
    assert {e.shape[0] for e in embs} == {-(-30 // tp)}
    full = torch.cat(embs)
    assert torch.equal(full[:30], want["model.embed_tokens.weight"])
    assert full.shape[0] - 30 < tp and not full[30:].any()
    qkv0 = shards[0]["decoder.layers.0.self_attention.linear_qkv.weight"]
    d, g = shape.head_dim, 4 // tp
    q, k, v = split_qkv(qkv0, g, 2 * d, d)
    assert torch.equal(q, want["model.layers.0.self_attn.q_proj.weight"][: g * 2 * d])
    assert torch.equal(k, want["model.layers.0.self_attn.k_proj.weight"][: g * d])
    back = megatron_to_hf(shards, shape)
    assert back.keys() == want.keys()
    assert all(torch.equal(back[k], want[k]) for k in want)


def test_fuse_split_qkv_inverse():
    q, k, v = torch.randn(8, 3), torch.randn(4, 3), torch.randn(4, 3)
    fused = fuse_qkv(q, k, v, num_groups=2)
    assert torch.equal(fused[:4], q[:4]) and torch.equal(fused[4:6], k[:2])
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, 2, 4, 2), (q, k, v),
                                                  strict=True))


def test_unsupported_config_is_refused():
    with pytest.raises(ValueError, match="hidden_act"):
        ModelShape.from_hf_config(Qwen2Config(**SIZES, hidden_act="gelu"))


def _without_layer_types(config):
    config.layer_types = None
    return config


@pytest.mark.parametrize(("config", "named"), [
    (lambda: Qwen2Config(**SIZES, use_sliding_window=True, sliding_window=4, max_window_layers=0),
     "sliding_attention"),
    # a config without layer_types (as older transformers versions wrote it): the window keys
    (lambda: _without_layer_types(Qwen2Config(**SIZES, use_sliding_window=True, sliding_window=4,
                                              max_window_layers=0)), "use_sliding_window"),
    (lambda: LlamaConfig(**SIZES, attention_bias=True), "attention_bias"),
    (lambda: LlamaConfig(**SIZES, partial_rotary_factor=0.5), "partial_rotary_factor"),
])
def test_a_model_the_mapping_would_compute_otherwise_is_refused(config, named):
    """A sliding window, Llama's o_proj bias (``attention_bias``) and partial RoPE were mapped
    silently: Megatron then trained a policy other than the one the engine sampled (review,
    2026-11-29; the fast decoder refused them already)."""
    with pytest.raises(ValueError, match=named):
        ModelShape.from_hf_config(config())
