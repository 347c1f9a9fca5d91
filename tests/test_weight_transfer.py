"""Weight hand-off across processes without pickling: bucketed tensors over a process group."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import queue

import pytest
import torch

from infra.ports import free_port
from tests.trainer_fixtures import build_model, make_batch
from trainers.weight_transfer import (
    TensorMeta,
    decode_header,
    encode_header,
    pack,
    plan_buckets,
    unpack,
)

torch.set_num_threads(1)
WAIT_S = 120  # hang guard for the other process


def metas(*sizes: int) -> list[TensorMeta]:
    return [TensorMeta(f"t{i}", (n,), "float32") for i, n in enumerate(sizes)]


def test_buckets_cover_every_tensor_once_in_order_and_respect_the_size():
    ms = metas(10, 10, 30, 1, 1, 100, 5)  # bytes: 40, 40, 120, 4, 4, 400, 20
    buckets = plan_buckets(ms, 100)
    assert [i for a, b in buckets for i in range(a, b)] == list(range(len(ms)))
    for a, b in buckets:
        size = sum(m.nbytes for m in ms[a:b])
        assert size <= 100 or b - a == 1  # an oversize tensor travels alone
    assert (5, 6) in buckets
    assert plan_buckets([], 100) == []
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(ms, 0)


def test_pack_unpack_is_bitwise_for_every_dtype():
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g).bfloat16(),
               "c": torch.randint(-9, 9, (2, 3), generator=g), "d": torch.rand(4, generator=g) > 0.5,
               "e": torch.randn(6, 2, generator=g).t()}  # non-contiguous
    ms = [TensorMeta(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in
          tensors.items()]
    version, back_metas, buckets = decode_header(encode_header(7, ms, [(0, 5)]))
    assert version == 7 and back_metas == ms and buckets == [(0, 5)]
    out = unpack(pack(list(tensors.values()), "cpu"), ms)
    for k, v in tensors.items():
        assert out[k].dtype == v.dtype and torch.equal(out[k], v), k


def digests(named: dict[str, torch.Tensor]) -> dict[str, str]:
    """sha256 of each tensor's raw bytes (bitwise comparison across processes)."""
    return {k: hashlib.sha256(v.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            .hexdigest() for k, v in named.items()}


def _receiver(port: int, model_dir: str, versions: int, out) -> None:
    """Engine side: a real TorchEngine receives ``versions`` updates over gloo."""
    torch.set_num_threads(1)
    try:
        from rollout.torch_engine import TorchEngine
        from trainers.weight_transfer import WeightReceiver, new_group

        engine = TorchEngine(model_dir, eos_token_id=2, pad_token_id=0)
        receiver = WeightReceiver(new_group("127.0.0.1", port, 1, 2))
        for _ in range(versions):
            version = receiver.receive_into(engine)
            out.put(("ok", version, engine.weight_version,
                     digests({k: v for k, v in engine.model.state_dict().items()
                              if k != "lm_head.weight"})))
    except Exception as err:  # reported to the test, which fails with it
        out.put(("err", repr(err), None, None))


def test_two_processes_over_gloo_bitwise_across_two_versions(tmp_path):
    """Trainer (this process) -> engine (a spawned process) over gloo on 127.0.0.1, in small
    buckets: after each of two versions the engine's weights equal the trainer's bitwise."""
    from infra.config import TrainerConfig
    from trainers.torch_trainer import TorchTrainer
    from trainers.weight_transfer import WeightSender, new_group

    model_dir = build_model(tmp_path)
    port = free_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(port, model_dir, 2, results), daemon=True)
    proc.start()
    try:
        tr = TorchTrainer(model_dir, TrainerConfig(lr=5e-2), 2)
        sender = WeightSender(new_group("127.0.0.1", port, 0, 2), bucket_bytes=4096)
        for version in (1, 2):
            tr.train(make_batch([1.0, 0.0, 0.0, 1.0], seed=version, group_size=2))
            weights = {k: v for k, v in tr.state_dict().items() if k != "lm_head.weight"}
            stats = sender.send(weights.items(), version)
            assert stats["buckets"] > 1
            try:
                status, got_version, engine_version, got = results.get(timeout=WAIT_S)
            except queue.Empty:
                pytest.fail(f"the receiver sent nothing within {WAIT_S} s")
            assert status == "ok", got_version
            assert got_version == engine_version == version
            assert got == digests(weights)
    finally:
        proc.join(timeout=WAIT_S)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="no CUDA device")
def test_nccl_group_on_gpu_moves_cuda_tensors_bitwise():
    """On a GPU: a world of one NCCL transfer group broadcasts CUDA buckets (sender and
    receiver in one process are the same rank: this checks the NCCL path and the byte layout
    on the device; two GPUs are needed for two ranks)."""
    from trainers.weight_transfer import new_group

    group = new_group("127.0.0.1", free_port(), 0, 1, device="cuda")
    tensors = [torch.randn(1000, device="cuda").bfloat16(), torch.randn(7, 3, device="cuda")]
    ms = [TensorMeta(str(i), tuple(t.shape), str(t.dtype).removeprefix("torch."))
          for i, t in enumerate(tensors)]
    flat = pack(tensors, "cuda")
    group.broadcast(flat, 0).wait()
    out = unpack(flat, ms)
    assert all(torch.equal(out[str(i)], t) for i, t in enumerate(tensors))
