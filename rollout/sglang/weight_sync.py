"""Weight sync to SGLang servers: from disk (each worker reads the HF checkpoint) or over a
torch.distributed group (this process is rank 0 and broadcasts every tensor; gloo on CPU,
nccl on GPU).

The distributed path follows SGLang's protocol: every server joins the group through
``/init_weights_update_group`` (rank ``1 + i``, one rank per server at tp=1), and each bucket of
tensors is announced with ``/update_weights_from_distributed`` (names, dtypes, shapes) while
rank 0 broadcasts them in that order, all inside ``/begin_weight_update`` ...
``/end_weight_update``. The router does not forward these calls: they go to every worker.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import httpx
import torch

from infra.ports import free_port
from rollout.sglang.client import SGLangError, post

_GROUP_IDS = itertools.count()


def fan_out(client: httpx.Client, urls: list[str], endpoint: str, body: dict,
            timeout: float | None = 600.0) -> list[dict]:
    """POST the same admin call to every URL concurrently; raise the first failure."""
    with ThreadPoolExecutor(max_workers=max(1, len(urls))) as pool:
        futures = [pool.submit(post, client, u, endpoint, body, timeout) for u in urls]
        return [f.result() for f in futures]


def update_from_disk(client: httpx.Client, urls: list[str], checkpoint_dir: str, weight_version: str) -> None:
    """Every worker loads ``checkpoint_dir`` in place and serves it as ``weight_version``."""
    body = {"model_path": checkpoint_dir, "weight_version": weight_version, "flush_cache": True}
    fan_out(client, urls, "/update_weights_from_disk", body)


def iter_checkpoint_tensors(checkpoint_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor in the HF safetensors files of ``checkpoint_dir``."""
    from safetensors.torch import load_file

    files = sorted(Path(checkpoint_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{checkpoint_dir}: no *.safetensors files to broadcast")
    for f in files:
        yield from load_file(str(f)).items()


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors in order into lists of at most ``bucket_bytes`` (a larger tensor goes alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


def new_group(master_addr: str, master_port: int, world_size: int, group_name: str,
              backend: str, timeout_s: float = 300.0) -> torch.distributed.ProcessGroup:
    """Rank 0 of a process group rendezvousing at ``tcp://master_addr:master_port``, built the
    way SGLang's servers build theirs (TCP rendezvous, a store prefixed by ``group_name``), and
    usable without a default process group in this process."""
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    store, rank, world = next(c10d.rendezvous(
        f"tcp://{master_addr}:{master_port}", 0, world_size, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = c10d._new_process_group_helper(
        world, rank, [], c10d.Backend(backend), c10d.PrefixStore(group_name, store),
        group_name=group_name, timeout=timeout,
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world)}
    return pg


class DistributedWeightSender:
    """Rank 0 of a weight-update group spanning the given servers."""

    def __init__(self, client: httpx.Client, urls: list[str], backend: str = "gloo",
                 master_addr: str = "127.0.0.1", bucket_bytes: int = 256 << 20):
        self.client, self.urls, self.backend = client, list(urls), backend
        self.master_addr, self.bucket_bytes = master_addr, bucket_bytes
        # unique across processes: two runs on one machine must never share a store prefix
        self.group_name = f"rlake_weights_{os.getpid()}_{next(_GROUP_IDS)}"
        self.pg: torch.distributed.ProcessGroup | None = None

    def connect(self) -> None:
        """Create the group: servers join over HTTP while this process joins as rank 0."""
        port = free_port(self.master_addr)
        world = 1 + len(self.urls)
        with ThreadPoolExecutor(max_workers=len(self.urls)) as pool:
            futures = [
                pool.submit(post, self.client, url, "/init_weights_update_group", {
                    "master_address": self.master_addr, "master_port": port, "rank_offset": 1 + i,
                    "world_size": world, "group_name": self.group_name, "backend": self.backend,
                }, 600.0)
                for i, url in enumerate(self.urls)
            ]
            self.pg = new_group(self.master_addr, port, world, self.group_name, self.backend)
            for f in futures:
                f.result()

    def send(self, named: Iterable[tuple[str, torch.Tensor]], weight_version: str) -> int:
        """Broadcast every tensor to all servers; they serve ``weight_version`` afterwards.
        Returns the number of tensors sent."""
        if self.pg is None:
            self.connect()
        fan_out(self.client, self.urls, "/begin_weight_update", {})
        sent = 0
        try:
            groups = list(buckets(named, self.bucket_bytes))
            for k, bucket in enumerate(groups):
                last = k == len(groups) - 1
                body = {
                    "names": [n for n, _ in bucket],
                    "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                    "shapes": [list(t.shape) for _, t in bucket],
                    "group_name": self.group_name,
                    "flush_cache": last,
                    "weight_version": weight_version if last else None,
                }
                with ThreadPoolExecutor(max_workers=len(self.urls)) as pool:
                    futures = [pool.submit(post, self.client, u, "/update_weights_from_distributed", body, 600.0)
                               for u in self.urls]
                    for _, t in bucket:
                        torch.distributed.broadcast(t.detach().contiguous().cpu() if self.backend == "gloo" else t,
                                                    src=0, group=self.pg)
                    for f in futures:
                        f.result()
                sent += len(bucket)
        finally:
            fan_out(self.client, self.urls, "/end_weight_update", {})
        return sent

    def close(self) -> None:
        """Leave the group (best effort on servers that may be gone)."""
        for url in self.urls:
            try:
                post(self.client, url, "/destroy_weights_update_group", {"group_name": self.group_name}, 30.0)
            except SGLangError:
                pass
        if self.pg is not None:
            try:
                torch.distributed.destroy_process_group(self.pg)
            except Exception:  # noqa: BLE001 - the group may already be broken by a dead peer
                pass
            self.pg = None
