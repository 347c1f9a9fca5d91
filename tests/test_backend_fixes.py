"""Megatron ranks that die with a killed run, Megatron's SFT step, the torch engine's stop ids,
and settings refused at config load / start-up instead of failing late (review, 2026-11-29)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from infra import checks as startup
from infra.config import ConfigError, TrainerConfig, load_config
from rollout.sglang.config import SGLangConfig
from rollout.torch_engine import eos_token_ids
from tests.megatron_helpers import make_batch, save_tiny_model, trainer_config

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny_qwen2")  # 4 heads, 2 kv heads, 2 layers, MLP 128
    save_tiny_model(str(path), "qwen2", tie=True)
    return str(path)


# ---- 1. the spawned ranks die with the run's process ----------------------------------------

DRIVER = textwrap.dedent("""
    import sys, threading, time
    sys.path.insert(0, {repo!r})
    import torch
    torch.set_num_threads(1)
    from tests.megatron_helpers import make_batch, trainer_config
    from trainers.megatron.launch import SpawnedMegatronTrainer

    if __name__ == "__main__":  # the spawned ranks import this file again
        box = []
        # built from a thread that ends at once (as a step's thread would): the ranks outlive it
        t = threading.Thread(target=lambda: box.append(SpawnedMegatronTrainer(
            trainer_config(tensor_model_parallel_size=2), {ckpt!r})))
        t.start()
        t.join()
        trainer = box[0]
        time.sleep(1.0)
        trainer.compute_logprobs(make_batch(n_groups=1, n_per=2))  # the ranks still answer
        print("pids", *[p.pid for p in trainer.launcher._procs], flush=True)
        time.sleep(600)
""")


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's zombie is no rank left running)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


@pytest.mark.megatron
def test_megatron_ranks_die_when_the_run_is_killed(ckpt, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(repo=str(REPO), ckpt=ckpt))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=str(REPO))
    pids: list[int] = []
    try:
        line = proc.stdout.readline()
        assert line.startswith("pids"), f"driver failed: {line!r}\n{proc.stderr.read()[-3000:]}"
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in pids if _alive(p)], "megatron ranks outlived a kill -9 of the run"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        proc.stdout.close()
        proc.stderr.close()


# ---- 2. an SFT batch is one optimizer step, as on the torch trainer -------------------------

@pytest.mark.megatron
def test_megatron_sft_batch_is_one_optimizer_step_as_the_torch_trainer(ckpt):
    from trainers.megatron.trainer import MegatronTrainer
    from trainers.torch_trainer import TorchTrainer

    batch = make_batch(n_groups=2, n_per=4)  # 8 samples
    # global_batch_size 2 (RL steps of 2 samples) must not split the SFT batch into 4 steps;
    # micro-batches of 3 still split its single step
    cfg = TrainerConfig(**{k: v for k, v in vars(trainer_config(
        lr=1e-2, global_batch_size=2, micro_batch_size=3)).items()
        if k in TrainerConfig.model_fields})
    meg = MegatronTrainer(cfg, ckpt, n_samples_per_prompt=4, rollout_temperature=1.0)
    ref = TorchTrainer(ckpt, cfg, 4, 1.0, pad_token_id=0, device="cpu", dtype="fp32")
    try:
        got, want = [], []
        for _ in range(3):
            m = meg.train_sft(batch)
            assert m["optimizer_steps"] == 1.0
            got.append(m["sft_loss"])
            want.append(ref.train_sft(batch)["sft_loss"])
    finally:
        meg.close()
    assert got == pytest.approx(want, abs=1e-5)
    assert got[-1] < got[0]


# ---- 3. the torch engine stops on config.json's eos_token_id too ----------------------------

@pytest.mark.parametrize("model_eos, expected", [(11, (5, 2, 9, 11)), ([9, 12], (5, 2, 9, 12))])
def test_eos_token_ids_include_config_json_eos(tmp_path, model_eos, expected):
    """SGLang stops on config.json's eos_token_id and generation_config.json's (a union)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2",
                                                      "eos_token_id": model_eos}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    assert eos_token_ids(tmp_path, 5) == expected


def test_eos_token_ids_from_config_json_alone_and_a_bad_value(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert eos_token_ids(tmp_path, None) == (7,)
    assert eos_token_ids(tmp_path, 7) == (7,)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": "7"}))
    with pytest.raises(ValueError, match="config.json: eos_token_id must be an int"):
        eos_token_ids(tmp_path, 1)


# ---- 4. rollout.sglang.dist_backend is checked at config load -------------------------------

def _refused(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(QUICKSTART, overrides)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_sglang_dist_backend_must_be_gloo_or_nccl():
    message = _refused(["rollout.engine=sglang", "rollout.sglang.dist_backend=foo"])
    assert "rollout.sglang.dist_backend" in message and "'gloo'" in message
    with pytest.raises(ValueError, match="dist_backend"):
        SGLangConfig(dist_backend="foo")


@pytest.mark.parametrize("device", ["device=cpu", "device=auto", "rollout.sglang.device=cpu"])
def test_sglang_nccl_weight_sync_needs_device_cuda(device):
    sync = ["rollout.engine=sglang", "rollout.sglang.weight_sync=distributed"]
    extra = ["device=cuda"] if device.startswith("rollout") else []
    message = _refused([*sync, *extra, "rollout.sglang.dist_backend=nccl", device])
    assert "rollout.sglang.dist_backend 'nccl'" in message and "device: cuda" in message
    # allowed: nccl on cuda, gloo anywhere, nccl unused (disk sync)
    load_config(QUICKSTART, [*sync, "rollout.sglang.dist_backend=nccl", "device=cuda"])
    load_config(QUICKSTART, [*sync, "rollout.sglang.dist_backend=gloo", "device=cpu"])
    load_config(QUICKSTART, ["rollout.engine=sglang", "rollout.sglang.dist_backend=nccl",
                             "device=cpu"])


# ---- 5. Megatron settings that cannot run are refused before anything starts ----------------

MEGATRON = ["trainer.backend=megatron"]


def test_megatron_tp_must_divide_the_tiny_models_heads():
    message = _refused([*MEGATRON, "trainer.tensor_model_parallel_size=3"])
    assert "trainer.tensor_model_parallel_size=3" in message and "num_attention_heads" in message
    message = _refused([*MEGATRON, "trainer.tensor_model_parallel_size=4"])  # 4 heads, 2 kv
    assert "num_key_value_heads" in message
    load_config(QUICKSTART, [*MEGATRON, "trainer.tensor_model_parallel_size=2"])


def test_megatron_pipeline_parallel_refused_on_device_cpu():
    message = _refused([*MEGATRON, "trainer.pipeline_model_parallel_size=2", "device=cpu"])
    assert "trainer.pipeline_model_parallel_size=2" in message and "GPU" in message


@pytest.mark.parametrize("key", ["tensor_model_parallel_size", "pipeline_model_parallel_size"])
def test_model_parallel_sizes_need_the_megatron_backend(key):
    """The torch trainer trains one unsplit model: a TP or PP size asked of it was ignored."""
    message = _refused([f"trainer.{key}=2"])
    assert message.startswith(f"bad config value for 'trainer.{key}'"), message
    assert "needs trainer.backend 'megatron'" in message
    load_config(QUICKSTART, [f"trainer.{key}=1"])


def test_startup_check_reads_the_model_folders_heads(tmp_path):
    from infra.config import TinyModelConfig
    from infra.modeling import tiny_model

    ckpt = str(tiny_model(tmp_path / "model", TinyModelConfig()))  # 4 heads, 2 kv heads
    cfg = load_config(QUICKSTART, [*MEGATRON, f"model.path={ckpt}", f"home={tmp_path}",
                                   "trainer.tensor_model_parallel_size=3"])
    with pytest.raises(startup.StartupError) as err:
        startup.check(cfg)
    message = str(err.value)
    assert "\n" not in message
    assert "trainer.tensor_model_parallel_size=3" in message and "num_attention_heads" in message
    assert str(Path(ckpt) / "config.json") in message
    ok = load_config(QUICKSTART, [*MEGATRON, f"model.path={ckpt}", f"home={tmp_path}",
                                  "trainer.tensor_model_parallel_size=2"])
    startup.check_megatron_model(ok)


@pytest.mark.skipif(torch.cuda.is_available(), reason="PP on device auto runs where CUDA is")
def test_startup_check_refuses_pipeline_parallel_without_cuda(tmp_path):
    cfg = load_config(QUICKSTART, [*MEGATRON, f"home={tmp_path}",
                                   "trainer.pipeline_model_parallel_size=2"])
    with pytest.raises(startup.StartupError, match=r"trainer.pipeline_model_parallel_size=2 "
                                                   r"needs GPUs .* no CUDA device"):
        startup.check(cfg)
