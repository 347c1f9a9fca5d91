"""bench/gpu.py: a CPU smoke run of every measurement (--tiny), and a clean refusal without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def run_bench(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "bench.gpu", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)


def test_tiny_smoke_run_prints_every_figure():
    proc = run_bench("--tiny", "--repeat", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    figures = result["shapes"]["tiny"]
    for key in ("hf_step_tokens_per_s", "torch_trainer_step_tokens_per_s",
                "megatron_trainer_step_tokens_per_s", "engine_tokens_per_s",
                "hf_generate_tokens_per_s", "handoff_s", "megatron_hf_state_dict_s", "save_s"):
        assert figures[key] > 0, key
    assert figures["params"] > 1e5 and result["date"] and result["machine"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_refuses_without_a_gpu_unless_tiny():
    proc = run_bench()
    assert proc.returncode == 2 and "needs a CUDA device" in proc.stderr
