"""GPU figures for random-init Qwen2 models of the 0.5B and 1.5B shapes; one JSON line.

Per shape: tokens/s of one training call of the torch trainer and of the Megatron trainer (each
includes what its ``train`` does: old log-probs when needed, advantages, the optimizer step),
and of a plain HF bf16 forward+backward+fused AdamW over the same tokens (the yardstick);
the torch engine's generation tokens/s against HF ``generate`` (batch x new tokens, no early
stop); the in-process weight hand-off (trainer -> engine) and Megatron's ``hf_state_dict``
seconds; the torch trainer's checkpoint ``save`` seconds.

    python -m bench.gpu                        # on a CUDA machine: 0.5b and 1.5b
    python -m bench.gpu --tiny                 # a CPU smoke run of every measurement, tiny shapes
    python -m bench.gpu --shapes 0.5b --profile   # + torch.profiler's top ops of the two steps

Without a CUDA device and without ``--tiny`` it refuses (exit 2). Models are built offline.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import torch

SHAPES = {  # the published Qwen2 configurations' sizes (random weights)
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864, vocab_size=151936),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, intermediate_size=8960, vocab_size=151936),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, vocab_size=1000),
}


def build_model(out: Path, shape: dict, max_len: int) -> int:
    """A random-init Qwen2 of ``shape`` saved in fp32 (the trainers' master precision) in
    ``out``; returns its parameter count."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**shape, max_position_embeddings=max(max_len, 128),
                         tie_word_embeddings=True, rope_theta=1e6, use_sliding_window=False,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def random_batch(n: int, seq: int, prompt: int, vocab: int, seed: int = 0):
    """A TrainBatch of n samples, ``prompt`` prompt + ``seq - prompt`` response tokens."""
    from trainers.base import TrainBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (n, seq), generator=g).tolist()
    resp = seq - prompt
    return TrainBatch(sample_uids=[str(i) for i in range(n)],
                      prompt_token_ids=[r[:prompt] for r in ids],
                      response_token_ids=[r[prompt:] for r in ids], loss_mask=[[1] * resp] * n,
                      rollout_logprobs=[[] for _ in range(n)],
                      rewards=[float(i % 2) for i in range(n)],
                      group_keys=[f"g{i // 8}" for i in range(n)], weight_versions=[0] * n)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, repeat: int, warmup: int = 1) -> float:
    """Median seconds of ``fn`` after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def profile_table(fn, device: str, label: str, rows: int = 25) -> None:
    """One call of ``fn`` under ``torch.profiler`` (after the timed calls warmed it): the top
    ops by self device time, and the call's wall against its summed device time (a wall far
    above it means the step waits on the CPU: launches, Python), printed to stdout."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    wall = time.perf_counter() - start
    events = prof.key_averages()
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    busy_us = sum(getattr(e, "self_device_time_total", 0) for e in events)
    print(f"== profile {label}: wall {wall:.3f} s (profiled), device busy {busy_us / 1e6:.3f} s",
          flush=True)
    print(events.table(sort_by=key, row_limit=rows), flush=True)


def free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def hf_step_seconds(model_dir: Path, batch, micro: int, device: str, dtype: str,
                    repeat: int, profile: bool = False) -> float:
    """The yardstick: plain HF model in ``dtype`` (bf16 on GPU), forward + backward of the
    token cross entropy over the batch in micro-batches, one fused AdamW step."""
    from infra.modeling import load_transformers_model

    model = load_transformers_model(model_dir, device, dtype).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device == "cuda" or None)
    ids = torch.tensor([p + r for p, r in zip(batch.prompt_token_ids, batch.response_token_ids,
                                              strict=True)], device=device)

    def step():
        opt.zero_grad(set_to_none=True)
        for part in ids.split(micro):
            out = model(input_ids=part, labels=part)
            (out.loss * len(part) / len(ids)).backward()
        opt.step()
    seconds = timed(step, device, repeat)
    if profile:
        profile_table(step, device, "HF step")
    model = opt = None  # freed before the next measurement
    free(device)
    return seconds


def engine_figures(engine, model_dir: Path, device: str, dtype: str, gen_batch: int,
                   new_tokens: int, vocab: int) -> dict[str, float]:
    """tokens/s of the torch engine and of HF ``generate`` (sampling, no early stop)."""
    from infra.modeling import load_transformers_model
    from rollout.engine import SamplingParams

    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, vocab, (gen_batch, 16), generator=g).tolist()
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
    engine.eos_token_id = -1  # never stop early: every row makes new_tokens tokens
    eng_s = timed(lambda: engine.generate(prompts, sp), device, repeat=2)
    graphed, engine.cuda_graph = engine.cuda_graph, False
    eager_s = timed(lambda: engine.generate(prompts, sp), device, repeat=2) if graphed else eng_s
    engine.cuda_graph = graphed
    hf = load_transformers_model(model_dir, device, dtype).eval()
    ids = torch.tensor(prompts, device=device)

    def hf_generate():
        with torch.no_grad():
            hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                        max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    hf_s = timed(hf_generate, device, repeat=2)
    hf = None
    free(device)
    total = gen_batch * new_tokens
    return {"engine_tokens_per_s": total / eng_s, "engine_eager_tokens_per_s": total / eager_s,
            "hf_generate_tokens_per_s": total / hf_s,
            "engine_speedup_vs_hf": hf_s / eng_s}


def engine_for(model_dir: Path, args, device: str, dtype: str):
    from rollout.torch_engine import TorchEngine

    return TorchEngine(str(model_dir), eos_token_id=2, pad_token_id=0, device=device,
                       dtype=dtype, max_batch_size=args.gen_batch, cuda_graph=device == "cuda")


def torch_figures(model_dir: Path, batch, args, device: str, dtype: str) -> dict[str, float]:
    """Torch trainer step, engine vs HF generate, in-process hand-off, save."""
    from infra.config import TrainerConfig
    from trainers.torch_trainer import TorchTrainer

    cfg = TrainerConfig(lr=1e-6, global_batch_size=len(batch), micro_batch_size=args.micro,
                        recompute_granularity=args.recompute)
    trainer = TorchTrainer(str(model_dir), cfg, 8, device=device, dtype=dtype)
    step_s = timed(lambda: trainer.train(batch), device, args.repeat)
    if args.profile:
        profile_table(lambda: trainer.train(batch), device, "torch trainer train()")
    if args.train_only:
        return {"torch_trainer_step_s": step_s}
    engine = engine_for(model_dir, args, device, dtype)
    handoff_s = timed(lambda: engine.load_state_dict(trainer.state_dict(), 1), device, repeat=3)
    with tempfile.TemporaryDirectory() as d:
        save_s = timed(lambda: trainer.save(str(Path(d) / "ckpt")), device, repeat=1, warmup=0)
    trainer = None
    free(device)
    out = {"torch_trainer_step_s": step_s, "handoff_s": handoff_s, "save_s": save_s}
    out.update(engine_figures(engine, model_dir, device, dtype, args.gen_batch, args.gen_tokens,
                              args.vocab))
    engine = None
    free(device)
    return out


def megatron_figures(model_dir: Path, batch, args, dtype: str) -> dict[str, float]:
    from trainers.megatron.trainer import MegatronTrainer

    cfg = SimpleNamespace(lr=1e-6, eps_clip=0.2, eps_clip_high=None, eps_clip_c=None,
                          n_samples_per_prompt=8, advantage_estimator="grpo", use_kl_loss=False,
                          kl_loss_coef=0.0, entropy_coef=0.0, global_batch_size=len(batch),
                          micro_batch_size=args.micro, clip_grad=1.0,
                          rollout_temperature=1.0, tensor_model_parallel_size=1,
                          pipeline_model_parallel_size=1, weight_decay=0.0, adam_beta1=0.9,
                          adam_beta2=0.99, loss_aggregation="sample_mean")
    trainer = MegatronTrainer(cfg, str(model_dir), dtype=dtype)
    device = "cuda" if trainer.on_gpu else "cpu"
    step_s = timed(lambda: trainer.train(batch), device, args.repeat)
    gather_s = timed(trainer.hf_state_dict, device, repeat=2)
    trainer.close()
    trainer = None
    free(device)
    return {"megatron_trainer_step_s": step_s, "megatron_hf_state_dict_s": gather_s}


def measured(out: dict, errors: dict, name: str, fn) -> None:
    """Runs one measurement section into ``out``; a failure is recorded under ``errors[name]``
    (its traceback to stderr) so the other sections still run and print."""
    try:
        out.update(fn())
    except Exception as exc:  # noqa: BLE001 - one broken section must not hide the others
        traceback.print_exc()
        errors[name] = f"{type(exc).__name__}: {exc}"[:500]
    free("cuda" if torch.cuda.is_available() else "cpu")


def bench_shape(name: str, args, device: str, dtype: str) -> dict:
    shape = SHAPES[name]
    args.vocab = shape["vocab_size"]
    batch = random_batch(args.batch, args.seq, args.prompt, args.vocab)
    tokens = args.batch * args.seq
    out: dict[str, float] = {}
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as d:
        model_dir = Path(d) / name
        out["params"] = float(build_model(model_dir, shape, args.seq + args.gen_tokens + 16))
        if args.engine_only:
            measured(out, errors, "engine", lambda: engine_figures(
                engine_for(model_dir, args, device, dtype), model_dir, device, dtype,
                args.gen_batch, args.gen_tokens, args.vocab))
        else:
            measured(out, errors, "hf_step", lambda: {"hf_step_s": hf_step_seconds(
                model_dir, batch, args.micro, device, dtype, args.repeat, args.profile)})
            measured(out, errors, "torch", lambda: torch_figures(model_dir, batch, args, device,
                                                                 dtype))
        if not (args.skip_megatron or args.engine_only or args.train_only):
            measured(out, errors, "megatron", lambda: megatron_figures(model_dir, batch, args,
                                                                       dtype))
    for key in ("hf_step_s", "torch_trainer_step_s", "megatron_trainer_step_s"):
        if key in out:  # training tokens per second of one call
            out[key.removesuffix("_s") + "_tokens_per_s"] = tokens / out[key]
    result: dict = {k: round(v, 4) for k, v in out.items()}
    if errors:
        result["errors"] = errors
    print(json.dumps({"shape": name, **result}), flush=True)  # partial line: survives a later crash
    return result


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shapes, tiny sizes")
    p.add_argument("--shapes", default=None, help="comma list of 0.5b,1.5b (default both)")
    p.add_argument("--batch", type=int, default=None, help="sequences per training call (64)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (512)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens of them (64)")
    p.add_argument("--micro", type=int, default=None, help="micro-batch size (8)")
    p.add_argument("--gen-batch", type=int, default=None, help="generation batch (64)")
    p.add_argument("--gen-tokens", type=int, default=None, help="new tokens per row (256)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--recompute", choices=["full"], default=None,
                   help="activation checkpointing in the torch trainer")
    p.add_argument("--skip-megatron", action="store_true")
    p.add_argument("--train-only", action="store_true",
                   help="only the step figures (HF step, torch trainer): no engine, save, Megatron")
    p.add_argument("--profile", action="store_true",
                   help="print torch.profiler's top ops of one HF step and one torch trainer call")
    p.add_argument("--engine-only", action="store_true",
                   help="only the engine (CUDA graph and eager) against HF generate")
    args = p.parse_args(argv)
    small = dict(shapes="tiny", batch=8, seq=24, prompt=8, micro=4, gen_batch=4, gen_tokens=8)
    large = dict(shapes="0.5b,1.5b", batch=64, seq=512, prompt=64, micro=8, gen_batch=64,
                 gen_tokens=256)
    for key, value in (small if args.tiny else large).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        print("bench/gpu.py needs a CUDA device (torch sees none); --tiny runs a CPU smoke "
              "version of every measurement", file=sys.stderr)
        return 2
    if not cuda:
        torch.set_num_threads(1)
    device, dtype = ("cuda", "bf16") if cuda else ("cpu", "fp32")
    result = {"date": datetime.now(UTC).strftime("%Y-%m-%d"), "device": device, "dtype": dtype,
              "machine": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "batch": args.batch, "seq": args.seq,
              "micro": args.micro, "gen_batch": args.gen_batch, "gen_tokens": args.gen_tokens,
              "shapes": {}}
    for name in args.shapes.split(","):
        if name not in SHAPES:
            print(f"--shapes: unknown shape {name!r} (allowed: {', '.join(SHAPES)})",
                  file=sys.stderr)
            return 2
        result["shapes"][name] = bench_shape(name, args, device, dtype)
    print(json.dumps(result), flush=True)
    return 1 if any("errors" in r for r in result["shapes"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
