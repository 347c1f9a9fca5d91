"""Synthetic trajectory rows shaped like ``Sample.to_row`` output, for tests and benchmarks."""

from __future__ import annotations

import json
import random
from typing import Any

import pyarrow as pa

from buffer.schema import uid_step


def synthetic_rows(
    run_id: str,
    iteration: int,
    n: int = 512,
    weight_version: int | None = None,
    kind: str = "train",
    prompt_len: int = 32,
    response_len: int = 64,
    seed: int | None = None,
) -> list[dict[str, Any]]:
    """``n`` trajectory rows of one iteration (uids ``{run_id}/{iteration}/{i}``), deterministic per seed."""
    rng = random.Random(seed if seed is not None else hash((run_id, iteration)) & 0xFFFF)
    version = iteration if weight_version is None else weight_version
    step = uid_step(iteration, kind)
    rows = []
    for i in range(n):
        p = [rng.randrange(100) for _ in range(prompt_len)]
        r = [rng.randrange(100) for _ in range(response_len)]
        rows.append({
            "sample_uid": f"{run_id}/{step}/{i}",
            "run_id": run_id,
            "iteration": iteration,
            "weight_version": version,
            "group_index": i // 8,
            "sample_index": i,
            "kind": kind,
            "prompt": f"What is {p[0]} + {p[1]}?",
            "prompt_token_ids": p,
            "response": f"The answer is {p[0] + p[1]}.",
            "response_token_ids": r,
            "rollout_logprobs": [-rng.random() for _ in r],
            "loss_mask": [1] * len(r),
            "reward": float(rng.random() < 0.5),
            "reward_detail": json.dumps({"correct": True}),
            "label": str(p[0] + p[1]),
            "status": "completed",
            "finish_reason": "stop",
            "metadata": json.dumps({"temperature": 1.0}),
            "engine": "torch",
            "data_source": "synthetic/add",
            "row": i,
        })
    return rows


def relabel(base: pa.Table, run_id: str, iteration: int, weight_version: int | None = None) -> pa.Table:
    """An Arrow batch (``rows_to_table`` output) re-keyed as ``run_id``/``iteration`` cheaply.

    Sets run_id, iteration, weight_version (default: iteration) and sample_uid
    ``{run_id}/{iteration}/{i}``; the payload columns are reused as they are.
    """
    n = base.num_rows
    version = iteration if weight_version is None else weight_version
    new = {
        "sample_uid": pa.array([f"{run_id}/{iteration}/{i}" for i in range(n)], pa.string()),
        "run_id": pa.array([run_id] * n, pa.string()),
        "iteration": pa.array([iteration] * n, pa.int64()),
        "weight_version": pa.array([version] * n, pa.int64()),
    }
    for name, values in new.items():
        base = base.set_column(base.schema.get_field_index(name), base.schema.field(name), values)
    return base
