"""Generation throughput: real SGLang server(s) vs an HF ``generate`` loop, same tiny Qwen2,
same prompts and sampling. Prints figures and one JSON line (informational on CPU: SGLang's
CPU path runs the torch-native attention backend, none of its GPU kernels).

    /work/main/.venv/bin/python bench/engines.py --batch 64 --max-new-tokens 64

Needs .venv-sglang (scripts/setup_sglang.sh).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout.engine import SamplingParams  # noqa: E402
from rollout.sglang import SGLangConfig, SGLangEngine  # noqa: E402
from rollout.sglang.tiny_model import build_tiny_qwen2  # noqa: E402


def make_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    """n prompts of 4-12 random non-special token ids (ids 2..vocab-1)."""
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randrange(4, 13))] for _ in range(n)]


def hf_generate(model_dir: str, prompts: list[list[int]], sampling: SamplingParams, batch: int) -> tuple[int, float]:
    """Response tokens produced and seconds taken by batched HF ``generate`` (left padding, KV cache)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad, eos = model.config.pad_token_id, model.config.eos_token_id
    tokens, start = 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                                 temperature=sampling.temperature, top_p=sampling.top_p, top_k=0,
                                 max_new_tokens=sampling.max_new_tokens, pad_token_id=pad, eos_token_id=eos)
        for row in out[:, width:].tolist():
            tokens += next((k + 1 for k, t in enumerate(row) if t == eos), len(row))
    return tokens, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--num-servers", type=int, default=1)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="rlake-bench-") as tmp:
        model_dir = str(build_tiny_qwen2(Path(tmp) / "model", num_layers=args.layers, hidden=args.hidden))
        prompts = make_prompts(args.batch, 16, args.seed)
        sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)

        t0 = time.perf_counter()
        engine = SGLangEngine(model_dir, SGLangConfig(num_servers=args.num_servers, concurrency=args.batch,
                                                      log_dir=str(Path(tmp) / "logs")))
        startup = time.perf_counter() - t0
        try:
            engine.generate(prompts[:4], sampling)  # first-request warm-up
            t0 = time.perf_counter()
            results = engine.generate(prompts, sampling)
            sgl_s = time.perf_counter() - t0
        finally:
            engine.shutdown()
        sgl_tokens = sum(len(r.token_ids) for r in results)
        hf_tokens, hf_s = hf_generate(model_dir, prompts, sampling, args.batch)

    row = {
        "bench": "engines", "device": "cpu", "layers": args.layers, "hidden": args.hidden,
        "batch": args.batch, "max_new_tokens": args.max_new_tokens, "num_servers": args.num_servers,
        "sglang_startup_s": round(startup, 1),
        "sglang_tokens": sgl_tokens, "sglang_s": round(sgl_s, 3), "sglang_tokens_per_s": round(sgl_tokens / sgl_s, 1),
        "hf_tokens": hf_tokens, "hf_s": round(hf_s, 3), "hf_tokens_per_s": round(hf_tokens / hf_s, 1),
    }
    print(f"SGLang x{args.num_servers}: {sgl_tokens} tokens in {sgl_s:.2f} s = {row['sglang_tokens_per_s']} tok/s "
          f"(start-up {startup:.0f} s)")
    print(f"HF generate:  {hf_tokens} tokens in {hf_s:.2f} s = {row['hf_tokens_per_s']} tok/s")
    print(json.dumps(row))


if __name__ == "__main__":
    main()
