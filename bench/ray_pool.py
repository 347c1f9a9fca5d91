"""Rollout throughput with 1 vs 2 torch engines as Ray actors (1 torch thread each, same batch),
and what Ray adds per iteration: an actor call's round trip, a weight hand-off through the
object store, and the pool's overhead over one in-process engine. Prints figures and one JSON
line; never passes or fails on time.

    PYTHONPATH=. /work/main/.venv/bin/python bench/ray_pool.py --groups 32 --group-size 8 --repeats 3

Starts a local Ray on 127.0.0.1 behind rlake's guard (infra/cluster.py) and shuts it down.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infra.cluster import prepare_ray  # noqa: E402
from infra.config import ClusterConfig, TinyModelConfig  # noqa: E402
from infra.modeling import build_tiny_model, load_tokenizer  # noqa: E402
from rollout.engine import SamplingParams  # noqa: E402
from rollout.ray_engines import RayStateDictEnginePool  # noqa: E402
from rollout.torch_engine import TorchEngine  # noqa: E402


def prompts_for(groups: int, group_size: int) -> list[list[int]]:
    """``groups`` prompts "a+b=" as token ids stand-ins, each repeated ``group_size`` times."""
    return [[1, 4 + g % 20, 5 + (g * 7) % 20, 3] for g in range(groups) for _ in range(group_size)]


def timed(fn, repeats: int) -> float:
    """Median seconds of ``repeats`` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tiny", default="quickstart", choices=["quickstart", "small"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    prepare_ray()
    import ray

    tiny = TinyModelConfig() if args.tiny == "quickstart" else TinyModelConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(Path(tmp) / "model", tiny, seed=0)
        tok = load_tokenizer(path)
        build = partial(TorchEngine, str(path), tok.eos_token_id, tok.pad_token_id)
        prompts = prompts_for(args.groups, args.group_size)
        sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)
        tokens = len(prompts) * args.max_new_tokens  # upper bound; EOS may stop some rows early

        local = build()
        t_local = timed(lambda: local.generate(prompts, sampling), args.repeats)
        cluster = ClusterConfig(ray_address="local", max_engine_restarts=0)
        out: dict[str, float] = {"samples": len(prompts), "in_process_s": t_local}
        t0 = time.perf_counter()
        pools = {}
        try:
            for n in (1, 2):
                pools[n] = RayStateDictEnginePool(build, "torch", n, args.group_size, cluster, 0,
                                                  ray_cpus=3)  # both pools at once
                if n == 1:
                    out["ray_start_and_first_pool_s"] = time.perf_counter() - t0
                out[f"ray_{n}_engines_s"] = timed(lambda p=pools[n]: p.generate(prompts, sampling),
                                                  args.repeats)
            pool = pools[2]
            actor = pool.actors[0]
            out["actor_call_roundtrip_ms"] = 1000 * timed(
                lambda: ray.get(actor.weight_version.remote()), 20)
            weights = local.model.state_dict()
            out["weight_handoff_2_engines_ms"] = 1000 * timed(
                lambda: pool.load_state_dict(weights, 1), args.repeats)
            out["weights_mb"] = sum(v.numel() * v.element_size() for v in weights.values()) / 2**20
            tiny_batch = prompts[:args.group_size]
            out["pool_overhead_one_group_ms"] = 1000 * (
                timed(lambda: pools[1].generate(tiny_batch, sampling), args.repeats)
                - timed(lambda: local.generate(tiny_batch, sampling), args.repeats))
        finally:
            for p in pools.values():
                p.shutdown()
            if ray.is_initialized():
                ray.shutdown()
    out["speedup_2_vs_1"] = out["ray_1_engines_s"] / out["ray_2_engines_s"]
    for n in (1, 2):
        out[f"ray_{n}_engines_tok_per_s"] = tokens / out[f"ray_{n}_engines_s"]
    for k, v in out.items():
        print(f"{k:>32}: {v:.4g}")
    print(json.dumps({k: round(v, 5) for k, v in out.items()}))


if __name__ == "__main__":
    main()
