"""Shared pieces of the megatron backend tests and benchmark: tiny HF checkpoints, synthetic
rollout batches, and a plain HF/torch GRPO step to compare against."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from trainers import algorithms as alg
from trainers.base import TrainBatch


def tiny_config(kind: str = "qwen2", tie: bool = True, **sizes):
    base = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=128, vocab_size=31,
                max_position_embeddings=64, tie_word_embeddings=tie)
    base.update(sizes)
    return Qwen2Config(**base) if kind == "qwen2" else LlamaConfig(**base)


def save_tiny_model(path: str, kind: str = "qwen2", tie: bool = True, seed: int = 0,
                    **sizes) -> torch.nn.Module:
    """A random tiny HF causal LM saved as an HF checkpoint in ``path``; returns it."""
    torch.manual_seed(seed)
    cfg = tiny_config(kind, tie, **sizes)
    model = (Qwen2ForCausalLM if kind == "qwen2" else LlamaForCausalLM)(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return model


def make_batch(n_groups: int = 2, n_per: int = 4, vocab: int = 31, seed: int = 0) -> TrainBatch:
    """A synthetic rollout batch: ragged prompts/responses, 0/1 rewards, a partial loss mask."""
    rng = random.Random(seed)
    prompts, responses, masks, lps, rewards, keys = [], [], [], [], [], []
    for g in range(n_groups):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(3, 6))]
        for _ in range(n_per):
            r = [rng.randrange(vocab) for _ in range(rng.randint(2, 7))]
            prompts.append(prompt)
            responses.append(r)
            m = [1] * len(r)
            if len(r) > 4:
                m[1] = 0
            masks.append(m)
            lps.append([-rng.uniform(1.0, 4.0) for _ in r])
            rewards.append(float(rng.random() < 0.5))
            keys.append(f"run/0/{g}")
    n = len(prompts)
    return TrainBatch(sample_uids=[f"run/0/{i}" for i in range(n)], prompt_token_ids=prompts,
                      response_token_ids=responses, loss_mask=masks, rollout_logprobs=lps,
                      rewards=rewards, group_keys=keys, weight_versions=[0] * n)


def trainer_config(**over) -> SimpleNamespace:
    cfg = dict(lr=1e-3, eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=None,
               n_samples_per_prompt=4, advantage_estimator="grpo", use_kl_loss=False,
               kl_loss_coef=0.0, entropy_coef=0.01, global_batch_size=8, micro_batch_size=4,
               clip_grad=1.0, rollout_temperature=0.8, tensor_model_parallel_size=1,
               pipeline_model_parallel_size=1, weight_decay=0.01, adam_beta1=0.9,
               adam_beta2=0.99, loss_aggregation="sample_mean")
    cfg.update(over)
    return SimpleNamespace(**cfg)


def hf_response_logprobs(model, batch: TrainBatch, temperature: float,
                         with_entropy: bool = False):
    """Plain HF: log_softmax(logits / T) at the response tokens, [B, T] (+ entropy), mask."""
    n = len(batch)
    seqs = [p + r for p, r in zip(batch.prompt_token_ids, batch.response_token_ids, strict=True)]
    width = max(map(len, seqs))
    t_width = max(len(r) for r in batch.response_token_ids)
    ids = torch.zeros((n, width), dtype=torch.long)
    att = torch.zeros((n, width), dtype=torch.long)
    pos = torch.zeros((n, t_width), dtype=torch.long)
    tgt = torch.zeros((n, t_width), dtype=torch.long)
    mask = torch.zeros((n, t_width))
    for i, (p, r) in enumerate(zip(batch.prompt_token_ids, batch.response_token_ids,
                                   strict=True)):
        ids[i, :len(p) + len(r)] = torch.tensor(p + r)
        att[i, :len(p) + len(r)] = 1
        pos[i, :len(r)] = torch.arange(len(p) - 1, len(p) - 1 + len(r))
        tgt[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = torch.tensor(batch.loss_mask[i], dtype=torch.float32)
    logits = model(input_ids=ids, attention_mask=att).logits
    z = logits.gather(1, pos[..., None].expand(-1, -1, logits.shape[-1])) / temperature
    logp = alg.log_probs_from_logits(z, tgt)
    return logp, (alg.entropy_from_logits(z) if with_entropy else None), mask


def hf_grpo_step(model, batch: TrainBatch, cfg) -> dict[str, float]:
    """One full-batch GRPO optimizer step on a plain HF model with torch AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                            betas=(cfg.adam_beta1, cfg.adam_beta2))
    with torch.no_grad():
        old, _, mask = hf_response_logprobs(model, batch, cfg.rollout_temperature)
    adv = alg.grpo_advantages(torch.tensor(batch.rewards), cfg.n_samples_per_prompt)
    adv = adv[:, None] * mask
    logp, ent, _ = hf_response_logprobs(model, batch, cfg.rollout_temperature, True)
    pg, clipped = alg.compute_policy_loss(logp, old, adv, cfg.eps_clip, cfg.eps_clip_high,
                                          cfg.eps_clip_c)
    pg_loss = alg.aggregate_loss(pg, mask, cfg.loss_aggregation)
    ent_loss = alg.aggregate_loss(ent, mask, cfg.loss_aggregation)
    loss = pg_loss - cfg.entropy_coef * ent_loss
    opt.zero_grad()
    loss.backward()
    gn = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
    opt.step()
    return {"pg_loss": float(pg_loss.detach()), "entropy_loss": float(ent_loss.detach()),
            "grad_norm": float(gn)}


def weights_of(model) -> dict[str, torch.Tensor]:
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


@torch.no_grad()
def sample_with_megatron(trainer, prompts: list[list[int]], n_per: int, length: int,
                         temperature: float, gen: torch.Generator) -> TrainBatch:
    """Sample ``length`` tokens per sample from the trainer's own (TP=1) model, no KV cache."""
    from trainers.megatron.model import forward_logits

    ids = torch.tensor([p for p in prompts for _ in range(n_per)])
    lps = []
    for _ in range(length):
        logits = forward_logits(trainer.model, ids)[:, -1, :trainer.shape.vocab_size]
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        nxt = torch.multinomial(logp.exp(), 1, generator=gen)
        lps.append(logp.gather(1, nxt))
        ids = torch.cat([ids, nxt], dim=1)
    plen = len(prompts[0])
    n = ids.shape[0]
    return TrainBatch(
        sample_uids=[str(i) for i in range(n)], prompt_token_ids=ids[:, :plen].tolist(),
        response_token_ids=ids[:, plen:].tolist(), loss_mask=[[1] * length] * n,
        rollout_logprobs=torch.cat(lps, dim=1).tolist(), rewards=[0.0] * n,
        group_keys=[str(i // n_per) for i in range(n)], weight_versions=[0] * n)
