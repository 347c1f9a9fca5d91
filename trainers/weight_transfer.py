"""Weight hand-off between processes without pickling: bucketed tensors over a process group.

The path SGLang's ``update_weights_from_distributed`` takes: the trainer side (``WeightSender``)
broadcasts, the engine side (``WeightReceiver``) receives, over a process group of their own
(NCCL on GPU, gloo on CPU) that never touches either side's default group (Megatron's). One
update is

    header   int64 [2]: (version, header bytes)  then  uint8 [header bytes]: JSON
             {"version", "tensors": [[name, shape, dtype], ...], "buckets": [[first, last), ...]}
    buckets  one uint8 tensor each: the raw bytes of consecutive tensors, back to back
             (each starting at a multiple of 16 bytes)

so the receiver allocates each bucket once and views tensors into it (bitwise exact, any dtype).
Buckets hold at most ``bucket_bytes`` (a larger tensor travels alone). In one process no group is
needed: ``TorchEngine.load_state_dict`` copies the trainer's tensors device to device.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_BUCKET_BYTES = 512 * 2**20
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
    torch.int8, torch.uint8, torch.bool)}


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * DTYPES[self.dtype].itemsize


def plan_buckets(metas: list[TensorMeta], bucket_bytes: int) -> list[tuple[int, int]]:
    """Consecutive [first, last) tensor ranges, each <= bucket_bytes unless one tensor alone
    is larger (it then travels alone); every tensor in exactly one bucket, in order."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[tuple[int, int]] = []
    first, size = 0, 0
    for i, m in enumerate(metas):
        if i > first and size + m.nbytes > bucket_bytes:
            buckets.append((first, i))
            first, size = i, 0
        size += m.nbytes
    if metas:
        buckets.append((first, len(metas)))
    return buckets


ALIGN = 16  # every tensor starts at a multiple of 16 bytes: a byte view can become any dtype


def offsets(metas: list[TensorMeta]) -> tuple[list[int], int]:
    """(start byte of each tensor, total bytes) when packed back to back, each start rounded
    up to a multiple of ALIGN."""
    starts, pos = [], 0
    for m in metas:
        pos = -(-pos // ALIGN) * ALIGN
        starts.append(pos)
        pos += m.nbytes
    return starts, pos


def packed_size(metas: list[TensorMeta]) -> int:
    return offsets(metas)[1]


def pack(tensors: list[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """The raw bytes of ``tensors`` in one uint8 tensor on ``device`` (layout: ``offsets``),
    each copied once straight from where it lives."""
    metas = [TensorMeta(str(i), tuple(t.shape), str(t.dtype).removeprefix("torch."))
             for i, t in enumerate(tensors)]
    starts, total = offsets(metas)
    flat = torch.zeros(total, dtype=torch.uint8, device=device)
    for t, start, m in zip(tensors, starts, metas, strict=True):
        flat[start:start + m.nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return flat


def unpack(flat: torch.Tensor, metas: list[TensorMeta]) -> dict[str, torch.Tensor]:
    """Views into ``flat`` (uint8) with each meta's dtype and shape: the inverse of ``pack``."""
    starts, total = offsets(metas)
    if total != flat.numel():
        raise ValueError(f"bucket holds {flat.numel()} bytes, its tensors {total}")
    return {m.name: flat[start:start + m.nbytes].view(DTYPES[m.dtype]).view(m.shape)
            for m, start in zip(metas, starts, strict=True)}


def encode_header(version: int, metas: list[TensorMeta], buckets: list[tuple[int, int]]) -> bytes:
    return json.dumps({"version": version, "buckets": buckets,
                       "tensors": [[m.name, list(m.shape), m.dtype] for m in metas]}).encode()


def decode_header(raw: bytes) -> tuple[int, list[TensorMeta], list[tuple[int, int]]]:
    doc = json.loads(raw.decode())
    metas = [TensorMeta(n, tuple(s), d) for n, s, d in doc["tensors"]]
    return int(doc["version"]), metas, [tuple(b) for b in doc["buckets"]]


def backend_for(device: str) -> str:
    """nccl for CUDA tensors (gloo cannot move them), gloo on CPU."""
    return "nccl" if device == "cuda" else "gloo"


def new_group(host: str, port: int, rank: int, world_size: int, device: str = "cpu",
              timeout_s: float = 300.0) -> dist.ProcessGroup:
    """A process group of its own (rank 0 = the sender, hosts the TCP store on host:port),
    independent of any default group this process already belongs to."""
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0,
                          timeout=timedelta(seconds=timeout_s))
    if device == "cuda":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    return dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout_s))


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, src: int) -> None:
    group.broadcast(tensor, src).wait()


class WeightSender:
    """The trainer side: ``send(named_tensors, version)`` broadcasts one weight version."""

    def __init__(self, group: dist.ProcessGroup, device: str = "cpu", src: int = 0,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.group, self.device, self.src, self.bucket_bytes = group, device, src, bucket_bytes

    def send(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        items = list(named)
        metas = [TensorMeta(n, tuple(t.shape), str(t.dtype).removeprefix("torch."))
                 for n, t in items]
        for m in metas:
            if m.dtype not in DTYPES:
                raise ValueError(f"tensor {m.name}: dtype {m.dtype} cannot be sent")
        buckets = plan_buckets(metas, self.bucket_bytes)
        header = encode_header(version, metas, buckets)
        _broadcast(self.group, torch.tensor([version, len(header)], dtype=torch.int64,
                                            device=self.device), self.src)
        _broadcast(self.group, torch.frombuffer(bytearray(header), dtype=torch.uint8)
                   .to(self.device), self.src)
        for first, last in buckets:
            _broadcast(self.group, pack([t for _, t in items[first:last]], self.device), self.src)
        return {"tensors": float(len(metas)), "buckets": float(len(buckets)),
                "bytes": float(sum(m.nbytes for m in metas))}


class WeightReceiver:
    """The engine side: ``receive()`` -> (version, {name: tensor}) of one broadcast version;
    ``receive_into(engine)`` hands them to an engine with ``load_state_dict``."""

    def __init__(self, group: dist.ProcessGroup, device: str = "cpu", src: int = 0) -> None:
        self.group, self.device, self.src = group, device, src

    def receive(self) -> tuple[int, dict[str, torch.Tensor]]:
        head = torch.zeros(2, dtype=torch.int64, device=self.device)
        _broadcast(self.group, head, self.src)
        raw = torch.empty(int(head[1]), dtype=torch.uint8, device=self.device)
        _broadcast(self.group, raw, self.src)
        version, metas, buckets = decode_header(bytes(raw.cpu().numpy()))
        out: dict[str, torch.Tensor] = {}
        for first, last in buckets:
            part = metas[first:last]
            flat = torch.empty(packed_size(part), dtype=torch.uint8, device=self.device)
            _broadcast(self.group, flat, self.src)
            out.update(unpack(flat, part))
        return version, out

    def receive_into(self, engine) -> int:
        """Receive one version and load it into ``engine``; returns the version."""
        version, weights = self.receive()
        engine.load_state_dict(weights, version)
        return version
