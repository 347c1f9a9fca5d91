"""device/dtype plumbing, the old-log-prob pass skipped when the policy cannot have moved,
activation checkpointing, bf16 autocast (on CPU here), and the torch engine's finished-row
compaction and in-process weight hand-off."""

from __future__ import annotations

import pytest
import torch

from infra.config import ConfigError, TinyModelConfig, config_from_dict
from infra.modeling import build_tiny_model, load_model, placement, resolve_device, resolve_dtype
from rollout.engine import SamplingParams
from rollout.torch_engine import TorchEngine
from tests.trainer_fixtures import build_model, make_batch, trainer

torch.set_num_threads(1)


# ---- config ----
def test_device_and_dtype_resolution():
    assert resolve_device("auto", cuda_available=False) == "cpu"
    assert resolve_device("auto", cuda_available=True) == "cuda"
    assert resolve_device("cpu", cuda_available=True) == "cpu"
    assert resolve_dtype("auto", "cuda") == "bf16" and resolve_dtype("auto", "cpu") == "fp32"
    assert resolve_dtype("bf16", "cpu") == "bf16"
    with pytest.raises(ConfigError, match="'device'.*no CUDA device"):
        resolve_device("cuda", cuda_available=False)


def test_bad_device_or_dtype_names_the_key():
    with pytest.raises(ConfigError, match="'device'"):
        config_from_dict({"device": "tpu"})
    with pytest.raises(ConfigError, match="'dtype'"):
        config_from_dict({"dtype": "fp16"})
    with pytest.raises(ConfigError, match="'trainer.recompute_granularity'"):
        config_from_dict({"trainer": {"recompute_granularity": "selective"}})
    cfg = config_from_dict({})
    assert (cfg.device, cfg.dtype) == ("auto", "auto")
    if not torch.cuda.is_available():
        assert placement(cfg.device, cfg.dtype) == ("cpu", "fp32")


# ---- trainer ----
def count_forwards(model: torch.nn.Module) -> list[int]:
    calls = [0]
    model.base_model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def after_one_call(model_dir: str, reuse: bool, **overrides):
    tr = trainer(model_dir, 4, **overrides)
    tr.reuse_grad_pass_logprobs = reuse
    calls = count_forwards(tr.model)
    metrics = tr.train(make_batch([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0], seed=5,
                                  rollout_logprobs=[[-1.5] * 5] * 8))
    return metrics, {k: v.detach().clone() for k, v in tr.model.state_dict().items()}, calls[0]


@pytest.mark.parametrize("overrides", [
    {},
    {"micro_batch_size": 3, "loss_aggregation": "token_mean", "entropy_coef": 0.01},
    {"advantage_estimator": "gspo", "use_tis": True},
    {"use_kl_loss": True, "kl_loss_coef": 0.1},
])
def test_old_logprobs_from_the_grad_pass_equal_the_separate_forward(tmp_path, overrides):
    """One optimizer step per rollout: taking lp_old from the grad pass gives the loss, the
    metrics and the updated weights of today's separate no-grad forward, with fewer forwards."""
    model_dir = build_model(tmp_path)
    m_old, w_old, f_old = after_one_call(model_dir, False, **overrides)
    m_new, w_new, f_new = after_one_call(model_dir, True, **overrides)
    micro = -(-8 // overrides.get("micro_batch_size", 256))
    assert f_new == f_old - micro  # the no-grad pass over the batch is gone
    assert m_new.keys() == m_old.keys()
    for k in m_old:
        assert m_new[k] == pytest.approx(m_old[k], abs=1e-6, rel=1e-6), k
    assert m_new["pg_clipfrac"] == 0.0 and m_new["ppo_kl"] == 0.0
    for k in w_old:
        torch.testing.assert_close(w_new[k], w_old[k], atol=1e-7, rtol=0, msg=k)


def test_old_logprob_forward_kept_when_the_policy_moves_or_kl_is_in_the_reward(tmp_path):
    model_dir = build_model(tmp_path)
    assert not trainer(model_dir, 4, global_batch_size=4)._old_logprobs_from_grad_pass(8)
    assert trainer(model_dir, 4, global_batch_size=8)._old_logprobs_from_grad_pass(8)
    kl_reward = trainer(model_dir, 4, advantage_estimator="reinforce_plus_plus", kl_coef=0.1)
    assert not kl_reward._old_logprobs_from_grad_pass(8)


def test_activation_checkpointing_gives_the_same_update(tmp_path):
    model_dir = build_model(tmp_path)
    m_plain, w_plain, _ = after_one_call(model_dir, True)
    m_ckpt, w_ckpt, _ = after_one_call(model_dir, True, recompute_granularity="full")
    assert m_ckpt["pg_loss"] == pytest.approx(m_plain["pg_loss"], abs=1e-6)
    for k in w_plain:
        torch.testing.assert_close(w_ckpt[k], w_plain[k], atol=1e-6, rtol=0, msg=k)


def test_bf16_autocast_keeps_fp32_master_weights_and_trains(tmp_path):
    """dtype bf16 (run here on CPU's autocast): fp32 parameters and AdamW state, bf16 compute;
    the step moves the weights the way the fp32 step does, within bf16 rounding."""
    from infra.config import TrainerConfig
    from trainers.torch_trainer import TorchTrainer

    model_dir = build_model(tmp_path)
    batch = make_batch([1.0, 0.0, 1.0, 0.0], seed=2)
    deltas = {}
    for dtype in ("fp32", "bf16"):
        tr = TorchTrainer(model_dir, TrainerConfig(lr=1e-2), 4, dtype=dtype)
        before = {k: v.detach().clone() for k, v in tr.model.named_parameters()}
        metrics = tr.train(batch)
        assert all(p.dtype == torch.float32 for p in tr.model.parameters())
        state = tr.optimizer.state[next(tr.model.parameters())]
        assert state["exp_avg"].dtype == torch.float32
        assert torch.isfinite(torch.tensor(metrics["pg_loss"]))
        deltas[dtype] = torch.cat([(p.detach() - before[k]).flatten()
                                   for k, p in tr.model.named_parameters()])
    cos = torch.nn.functional.cosine_similarity(deltas["fp32"], deltas["bf16"], dim=0)
    assert deltas["bf16"].abs().max() > 0 and cos > 0.95


# ---- engine ----
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from infra.modeling import load_tokenizer

    path = build_tiny_model(tmp_path_factory.mktemp("tiny"),
                            TinyModelConfig(max_position_embeddings=128), seed=3)
    return path, load_tokenizer(path)


PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [15], [6, 6, 6, 6], [20, 21]]


def greedy(engine: TorchEngine, stop: tuple[int, ...]) -> list[list[int]]:
    sp = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=stop)
    return [r.token_ids for r in engine.generate(PROMPTS, sp)]


@pytest.fixture(scope="module")
def chaotic(tiny, tmp_path_factory):
    """The tiny model with its matrices perturbed, so greedy outputs vary along a row (the
    random init alone just repeats the last prompt token)."""
    path, tok = tiny
    model = load_model(path)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    out = tmp_path_factory.mktemp("chaotic")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out, tok


def test_compaction_keeps_greedy_tokens(chaotic, monkeypatch):
    """Rows stopping early are dropped from the batch (and its KV cache); the greedy tokens
    equal those of the uncompacted batch and of HF's own forward (no fast decoder)."""
    path, tok = chaotic
    engine = TorchEngine(str(path), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    plain = greedy(engine, ())
    # stop ids taken from inside some rows, so rows finish at different steps
    stop = tuple(sorted({plain[0][3], plain[3][4], plain[5][1]}))
    compacted = greedy(engine, stop)
    assert len({len(r) for r in compacted}) > 2
    assert all(p[:len(c)] == c for p, c in zip(plain, compacted, strict=True))
    monkeypatch.setattr("rollout.torch_engine.should_compact", lambda *_: False)
    assert greedy(engine, stop) == compacted
    engine.fast = None  # HF's forward with a DynamicCache
    assert greedy(engine, stop) == compacted


def test_in_process_hand_off_copies_into_the_engine_without_reallocating(chaotic, tmp_path):
    """trainer.state_dict() hands views (no copy); the engine copies them into its own
    parameters and re-fills the fast decoder's fused matrices in place."""
    from infra.config import TrainerConfig
    from trainers.torch_trainer import TorchTrainer

    path, tok = chaotic
    tr = TorchTrainer(str(path), TrainerConfig(lr=5e-2), 2, pad_token_id=tok.pad_token_id)
    tr.train(make_batch([1.0, 0.0, 1.0, 0.0], seed=1, group_size=2))
    weights = tr.state_dict()
    params = dict(tr.model.named_parameters())
    assert all(weights[k].data_ptr() == params[k].data_ptr() for k in params)
    engine = TorchEngine(str(path), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    ptrs = [p.data_ptr() for p in engine.model.parameters()]
    fused = engine.fast.layers[0].qkv_w.data_ptr()
    engine.load_state_dict(weights, 1)
    assert [p.data_ptr() for p in engine.model.parameters()] == ptrs
    assert engine.fast.layers[0].qkv_w.data_ptr() == fused
    for k, v in engine.model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    tr.save(str(tmp_path / "v1"))
    fresh = TorchEngine(str(tmp_path / "v1"), eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
    assert greedy(engine, ()) == greedy(fresh, ())


def graphed_greedy(engine: TorchEngine, stop: tuple[int, ...], monkeypatch) -> list[list[int]]:
    """greedy() through the CUDA-graph step's static code path, run eagerly (no capture)."""
    from rollout.cuda_graph import GraphedDecode, graph_slots
    from rollout.torch_engine import _GraphStep

    made = []

    def stepper(batch, max_len):
        made.append(GraphedDecode(engine.fast, batch, graph_slots(max_len), capture=False))
        return _GraphStep(made[-1])
    monkeypatch.setattr(engine, "_stepper", stepper)
    out = greedy(engine, stop)
    assert made and made[0].slots % 64 == 0 and made[0].cache[0].shape[3] == made[0].slots
    monkeypatch.undo()
    return out


def test_static_decode_step_gives_the_fast_decoders_tokens(chaotic, monkeypatch):
    """The step a CUDA graph captures (fixed cache of T slots, slot index as a tensor, masked
    attention over all slots, no compaction) decodes the same greedy tokens as the dynamic
    fast decoder, with rows stopping at different steps."""
    path, tok = chaotic
    engine = TorchEngine(str(path), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    plain = greedy(engine, ())
    stop = tuple(sorted({plain[0][3], plain[3][4], plain[5][1]}))
    assert graphed_greedy(engine, (), monkeypatch) == plain
    assert graphed_greedy(engine, stop, monkeypatch) == greedy(engine, stop)


def test_bf16_engine_runs_in_bf16_on_cpu(tiny):
    """dtype bf16: bf16 weights and KV cache; its log-probs stay near an fp32 recomputation."""
    path, tok = tiny
    engine = TorchEngine(str(path), eos_token_id=-1, pad_token_id=tok.pad_token_id, dtype="bf16")
    assert engine.fast.new_cache(1, 4)[0].dtype == torch.bfloat16
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=1.0, seed=0))
    ref = load_model(path)
    for prompt, res in zip(PROMPTS, out, strict=True):
        ids = torch.tensor([prompt + res.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(ref(input_ids=ids).logits[0].float(), -1)
        want = logp[len(prompt) - 1:-1].gather(-1, torch.tensor(res.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(res.logprobs), want, atol=0.1, rtol=0)


# ---- GPU (skipped only where no CUDA device exists) ----
no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.gpu
@no_cuda
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpu_trainer_and_engine_agree(tiny, dtype):
    """On CUDA: the engine's rollout log-probs match the trainer's recomputation (fp32 tight,
    bf16 loose), a train step runs, and the hand-off casts into the engine's dtype."""
    from infra.config import TrainerConfig
    from trainers.torch_trainer import TorchTrainer

    path, tok = tiny
    engine = TorchEngine(str(path), eos_token_id=-1, pad_token_id=tok.pad_token_id,
                         device="cuda", dtype=dtype)
    tr = TorchTrainer(str(path), TrainerConfig(lr=1e-2), 1, pad_token_id=tok.pad_token_id,
                      device="cuda", dtype=dtype)
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=1.0, seed=0))
    from trainers.base import TrainBatch
    batch = TrainBatch(sample_uids=[str(i) for i in range(len(PROMPTS))], prompt_token_ids=PROMPTS,
                       response_token_ids=[r.token_ids for r in out],
                       loss_mask=[[1] * len(r.token_ids) for r in out],
                       rollout_logprobs=[r.logprobs for r in out],
                       rewards=[float(i % 2) for i in range(len(PROMPTS))],
                       group_keys=[f"g{i}" for i in range(len(PROMPTS))],
                       weight_versions=[0] * len(PROMPTS))
    metrics = tr.train(batch)
    tol = 1e-3 if dtype == "fp32" else 0.1
    assert metrics["train_rollout_logprob_abs_diff"] < tol
    engine.load_state_dict(tr.state_dict(), 1)
    assert next(engine.model.parameters()).dtype == (torch.bfloat16 if dtype == "bf16"
                                                     else torch.float32)


def test_gpu_config_loads_and_builds_tens_of_millions_of_parameters():
    from pathlib import Path

    from transformers import AutoModelForCausalLM, Qwen2Config

    from infra.config import load_config
    from infra.modeling import build_char_tokenizer

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "gpu.yaml")
    assert cfg.device == "auto" and cfg.dtype == "auto"
    tiny = cfg.model.tiny
    config = Qwen2Config(vocab_size=len(build_char_tokenizer()), hidden_size=tiny.hidden_size,
                         num_hidden_layers=tiny.num_hidden_layers,
                         num_attention_heads=tiny.num_attention_heads,
                         num_key_value_heads=tiny.num_key_value_heads,
                         intermediate_size=tiny.intermediate_size, tie_word_embeddings=True)
    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert 10e6 <= n <= 100e6
    assert cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt \
        <= cfg.trainer.global_batch_size  # one optimizer step per rollout


@pytest.mark.gpu
@no_cuda
def test_gpu_ppo_with_kl_critic_and_reference_train_save_and_load(tiny, tmp_path):
    """On CUDA in bf16: PPO (critic) with KL in the loss (reference) trains, saves, loads."""
    from infra.config import TrainerConfig
    from trainers.torch_trainer import TorchTrainer

    path, tok = tiny
    cfg = TrainerConfig(lr=1e-3, advantage_estimator="ppo", use_kl_loss=True, kl_loss_coef=0.1,
                        recompute_granularity="full")
    tr = TorchTrainer(str(path), cfg, 2, device="cuda", dtype="bf16")
    metrics = tr.train(make_batch([1.0, 0.0, 1.0, 0.0], seed=4, group_size=2))
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert next(tr.reference().parameters()).dtype == torch.bfloat16
    tr.save(str(tmp_path / "v1"))
    again = TorchTrainer(str(path), cfg, 2, device="cuda", dtype="bf16")
    again.load(str(tmp_path / "v1"))
    assert again.weight_version == 1 and next(again.critic.parameters()).is_cuda
    for k, v in tr.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[k], v), k


@pytest.mark.gpu
@no_cuda
def test_gpu_chunked_logprobs_equal_full_under_bf16_autocast():
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(64, 128, device="cuda", generator=g, requires_grad=True)
    w = torch.randn(5000, 128, device="cuda", generator=g, requires_grad=True)
    targets = torch.randint(0, 5000, (64,), device="cuda", generator=g)
    from trainers.logprobs import chunked_logprobs

    with torch.autocast("cuda", dtype=torch.bfloat16):
        logp, ent = chunked_logprobs(h, w, targets, 1.0, chunk=1024)
        z = (h @ w.t()).float()
    full = torch.log_softmax(z, -1).gather(-1, targets[:, None])[:, 0]
    torch.testing.assert_close(logp, full, atol=1e-3, rtol=1e-3)
    gh, gw = torch.autograd.grad(logp.sum() + ent.sum(), (h, w))
    from trainers import algorithms as alg
    rh, rw = torch.autograd.grad(full.sum() + alg.entropy_from_logits(z).sum(), (h, w))
    torch.testing.assert_close(gh, rh, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(gw, rw, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@no_cuda
def test_gpu_engine_compaction_and_fast_decoder_match_hf_greedy(chaotic):
    path, tok = chaotic
    engine = TorchEngine(str(path), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         device="cuda", dtype="fp32")
    plain = greedy(engine, ())
    stop = tuple(sorted({plain[0][3], plain[3][4], plain[5][1]}))
    fast = greedy(engine, stop)
    engine.fast = None
    assert greedy(engine, stop) == fast


@pytest.mark.gpu
@no_cuda
def test_gpu_cuda_graph_engine_matches_eager_and_follows_the_hand_off(chaotic, tmp_path):
    """On CUDA the decode step is a captured graph: the same greedy tokens as the eager fast
    decoder, one graph reused across calls, and after an in-place weight hand-off the graph
    decodes with the new weights (its log-probs move with them)."""
    from infra.config import TrainerConfig
    from trainers.torch_trainer import TorchTrainer

    path, tok = chaotic
    kw = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, device="cuda",
              dtype="fp32")
    graphed = TorchEngine(str(path), cuda_graph=True, **kw)
    eager = TorchEngine(str(path), **kw)
    plain = greedy(eager, ())
    stop = tuple(sorted({plain[0][3], plain[3][4], plain[5][1]}))
    assert greedy(graphed, ()) == plain
    assert greedy(graphed, stop) == greedy(eager, stop)
    assert len(graphed._graphs) == 1 and graphed._graphs[next(iter(graphed._graphs))].graph

    def logprobs(engine):  # every row runs 12 tokens: no early stop
        engine.eos_token_id = -1
        sp = SamplingParams(max_new_tokens=12, temperature=0.0)
        return torch.tensor([r.logprobs for r in engine.generate(PROMPTS, sp)])
    before = logprobs(graphed)
    tr = TorchTrainer(str(path), TrainerConfig(lr=5e-2), 2, pad_token_id=tok.pad_token_id,
                      device="cuda", dtype="fp32")
    tr.train(make_batch([1.0, 0.0, 1.0, 0.0], seed=1, group_size=2))
    graphed.load_state_dict(tr.state_dict(), 1)
    eager.load_state_dict(tr.state_dict(), 1)
    after = logprobs(graphed)
    assert (after - before).abs().max() > 1e-3
    torch.testing.assert_close(after, logprobs(eager), atol=1e-4, rtol=0)
    assert len(graphed._graphs) == 1
