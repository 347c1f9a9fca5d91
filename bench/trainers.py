"""Step time of the megatron backend (TP=1, CPU) against a plain HF/torch GRPO step.

Both do the same work per step: old log-probs (no grad), GRPO advantages, one forward/backward
over the whole batch, grad clip, AdamW. Sizes: the quickstart model (2 layers, hidden 128,
4 heads, 2 kv heads, intermediate 512, vocab 16, sequences ~12 tokens, batch 256) and a ~3M
parameter model. Steps alternate between the two (the machine is shared); medians and minima are reported.
Prints figures, then one JSON line. Usage: ``python -m bench.trainers``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from tests.megatron_helpers import hf_grpo_step, make_batch, save_tiny_model, trainer_config
from trainers.megatron.trainer import MegatronTrainer

SIZES = {
    "quickstart": dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=512, vocab_size=16),
    "3m": dict(num_hidden_layers=3, hidden_size=256, num_attention_heads=8,
               num_key_value_heads=4, intermediate_size=1024, vocab_size=16),
}


def _interleaved_times(fns: dict, warmup: int, repeat: int) -> dict[str, list[float]]:
    """Run the steps alternately (so load from other processes hits both alike); seconds."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return times


def bench_size(name: str, batch_size: int, warmup: int, repeat: int) -> dict[str, float]:
    sizes = SIZES[name]
    batch = make_batch(n_groups=batch_size // 8, n_per=8, vocab=sizes["vocab_size"], seed=1)
    cfg = trainer_config(n_samples_per_prompt=8, global_batch_size=batch_size,
                         micro_batch_size=batch_size, rollout_temperature=1.0)
    with tempfile.TemporaryDirectory() as d:
        hf = save_tiny_model(d, "qwen2", tie=True, **sizes)
        n_params = sum(p.numel() for p in hf.parameters())
        hf.train()
        trainer = MegatronTrainer(cfg, d)
        times = _interleaved_times({"torch": lambda: hf_grpo_step(hf, batch, cfg),
                                    "megatron": lambda: trainer.train(batch)}, warmup, repeat)
        trainer.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    return {"params": n_params, "torch_step_s": round(med["torch"], 4),
            "megatron_step_s": round(med["megatron"], 4),
            "ratio": round(med["megatron"] / med["torch"], 3),
            "torch_best_s": round(best["torch"], 4), "megatron_best_s": round(best["megatron"], 4),
            "ratio_best": round(best["megatron"] / best["torch"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {}
    for name in SIZES:
        r = bench_size(name, args.batch_size, args.warmup, args.repeat)
        results[name] = r
        print(f"{name:>10}: {r['params']:>9,d} params  torch {r['torch_step_s']:.4f} s/step  "
              f"megatron {r['megatron_step_s']:.4f} s/step  ratio {r['ratio']:.3f} (median; "
              f"best-of ratio {r['ratio_best']:.3f})")
    print(json.dumps({"bench": "trainers", "batch_size": args.batch_size,
                      "threads": args.threads, "device": "cpu", **results}))


if __name__ == "__main__":
    main()
