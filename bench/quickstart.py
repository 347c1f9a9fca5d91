"""Quickstart benchmark: the per-iteration time split of a short run, and the torch engine's
generation throughput against transformers' own ``generate``.

    python bench/quickstart.py [--iterations 8] [--no-generation] [--set key=value ...]

``--set model.path=CHECKPOINT --set sft.enabled=false`` starts from a saved SFT checkpoint;
``--set mode=async --set trainer.max_staleness=1`` splits async mode's training side
(``wait_rollout``: waiting for the rollout process's batch); ``--set prefect_task_runs=false``
runs the iteration's steps without Prefect task runs (tasks/step.py).

Prints figures (the split's medians with ``max_wall`` and ``walls_over_1s``, the stalls; the CPU
each of the run's processes used per iteration: ``bench/cpu.py``), then one JSON line. Timings
on a shared 2-core machine are noisy: compare the ratios within one run, not absolute seconds
across runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu import per_iteration_ms, process_tree_cpu  # noqa: E402
from bench.scratch import scratch_dir  # noqa: E402
from bench.served import embedded_prefect  # noqa: E402
from infra.env import configure_environment  # noqa: E402

# commit_wait: a sync iteration waiting for the previous one's commit, which ran behind while
# it generated (flows.steps.run_behind); record is then the hand-over only
PHASES = ["generate", "commit_wait", "score", "lake_write", "wait_rollout", "slice_read", "train",
          "publish", "record"]


def engine_vs_generate(batch: int = 64, new_tokens: int = 64, reps: int = 5) -> dict:
    """Tokens/s of TorchEngine vs HF generate, sampling, same model and prompts, alternated."""
    import torch

    from infra.config import TinyModelConfig
    from infra.modeling import build_tiny_model, load_tokenizer, load_transformers_model
    from rollout.engine import SamplingParams
    from rollout.torch_engine import TorchEngine

    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(tmp, TinyModelConfig(max_position_embeddings=128))
        tok = load_tokenizer(path)
        engine = TorchEngine(str(path), eos_token_id=-1, pad_token_id=tok.pad_token_id)
        # transformers' own model for its generate (the engine's is infra.qwen2's, no generate)
        hf_model = load_transformers_model(path).eval()
        prompts = [[tok.bos_token_id, *tok(f"{10 + i}+{99 - i}=", add_special_tokens=False)["input_ids"]]
                   for i in range(batch)]
        ids = torch.tensor(prompts)
        sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
        ours, theirs = [], []
        for _ in range(reps):
            start = time.perf_counter()
            out = engine.generate(prompts, sampling)
            ours.append(sum(len(r.token_ids) for r in out) / (time.perf_counter() - start))
            start = time.perf_counter()
            with torch.no_grad():
                gen = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                        max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                        pad_token_id=tok.pad_token_id)
            theirs.append((gen.shape[1] - ids.shape[1]) * batch / (time.perf_counter() - start))
    return {"engine_tokens_per_s": statistics.median(ours),
            "hf_generate_tokens_per_s": statistics.median(theirs),
            "engine_speedup": statistics.median(ours) / statistics.median(theirs),
            "batch": batch, "new_tokens": new_tokens}


def iteration_split(iterations: int, overrides: list[str] = ()
                    ) -> tuple[dict[str, float], dict[str, float]]:
    """Run the pipeline (short SFT, ``iterations`` RL iterations) and read the split back from the
    run loop's ``iteration`` events: each carries the iteration's ``time/*`` phases (``record``
    and ``total`` end after the ``train_steps`` row is written, so only the event has them), and
    ``wall``, the time between consecutive iterations' ends, counts Prefect's per-flow-run cost
    outside the flow function too. Returns (the split's medians, CPU milliseconds per iteration
    of each of the run's processes: ``bench.cpu``)."""
    from flows.rl import rl_run, set_reporter
    from infra.config import load_config

    home = scratch_dir("rlake-bench-")
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml",
                      [f"home={home}", f"num_rollout={iterations}", "sft.steps=20",
                       f"eval.eval_interval={iterations + 1}", *overrides])
    configure_environment(home, cfg.torch_threads)
    events: list[tuple[float, dict]] = []
    # after iteration 0 and after the one before the last (the last evaluates at its end)
    cpu_at = (0, iterations - 2)
    cpu: list[dict[str, float]] = []

    def on_event(event: str, payload: dict) -> None:
        if event == "iteration":
            events.append((time.perf_counter(), payload))
            if payload["iteration"] in cpu_at:
                cpu.append({**process_tree_cpu(), "wall": time.perf_counter()})

    set_reporter(on_event)
    try:
        rl_run(cfg.model_dump(), run_id="bench")
    finally:
        set_reporter(None)
    # iteration 0 pays one-off warm-up (and its wall has no previous end): leave it out
    rows = [{**{k[5:]: v for k, v in payload.items() if k.startswith("time/")}, "wall": end - prev}
            for (prev, _), (end, payload) in zip(events, events[1:], strict=False)]
    out = {name: statistics.median(r.get(name, 0.0) for r in rows) for name in [*PHASES, "total", "wall"]}
    out["in_flow_other"] = out["total"] - sum(out[p] for p in PHASES)
    out["outside_flow"] = out["wall"] - out["total"]
    # stalls: the "no multi-second stalls" (a 60 s one: docs/async-log.md)
    out["max_wall"] = max((r["wall"] for r in rows), default=0.0)
    out["walls_over_1s"] = float(sum(r["wall"] > 1.0 for r in rows))
    cpu_ms = per_iteration_ms(cpu[0], cpu[-1], cpu_at[1] - cpu_at[0]) if len(cpu) == 2 else {}
    return out, cpu_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        help="config override, e.g. model.path=CHECKPOINT or mode=async")
    parser.add_argument("--no-generation", action="store_true",
                        help="skip the engine vs HF generate comparison")
    args = parser.parse_args()
    home = scratch_dir("rlake-bench-env-")
    with embedded_prefect(home):  # the server a run of the CLI has
        configure_environment(home)
        measure(args)


def measure(args: argparse.Namespace) -> None:
    """``main``'s figures: the lines, then the JSON line."""
    gen = {} if args.no_generation else engine_vs_generate()
    if gen:
        print(f"torch engine: {gen['engine_tokens_per_s']:.0f} tok/s, HF generate: "
              f"{gen['hf_generate_tokens_per_s']:.0f} tok/s -> {gen['engine_speedup']:.2f}x "
              f"(batch {gen['batch']}, {gen['new_tokens']} new tokens, sampling)")
    split, cpu_ms = iteration_split(args.iterations, args.overrides)
    print("per-iteration median seconds: " + ", ".join(f"{k} {v:.3f}" for k, v in split.items()))
    if cpu_ms:  # means over iterations 1 .. n-2; each process with its threads
        wall = cpu_ms["wall"]
        print(f"CPU ms per iteration (mean wall {wall:.1f} ms, {cpu_ms['total'] / wall:.2f} cores): "
              + ", ".join(f"{k} {v:.1f}" for k, v in cpu_ms.items() if k != "wall"))
    print(json.dumps({"bench": "quickstart", "generation": gen, "iteration_seconds": split,
                      "cpu_ms_per_iteration": cpu_ms}))


if __name__ == "__main__":
    main()
