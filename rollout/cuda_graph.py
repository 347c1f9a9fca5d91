"""The torch engine's decode step replayed as a CUDA graph (``rollout.cuda_graph``).

Tested on an H200 (2026-11-26, docs/gpu.md): the same greedy tokens as the eager decoder, the
graph follows the weight hand-off, and the engine went from 3.1k to 23.3k tokens/s at 0.5B
(3.7k to 17.1k at 1.5B; batch 64 x 256 new tokens). On CPU the engine never captures; the
CPU tests run the static step eagerly.

A decode step of a 0.5B model is ~400 small kernels; launched one by one from Python the GPU
waits on the CPU (measured on an H100: 3.6k tokens/s at batch 64, 1.6x HF ``generate``). A CUDA
graph launches them all at once. A graph fixes every shape and address, so the step runs
``FastDecoder.decode_static``: a KV cache of a fixed T slots, the slot written given as a
tensor, attention over all T slots with a mask. Finished rows are not compacted away (that
would change the batch shape); they decode padding, which costs little next to the launches
saved. Graphs are kept per (batch, T rounded up to ``SLOT_BUCKET``) and reused across calls:
the prompts' width varies from call to call, the batch does not.
"""

from __future__ import annotations

import torch

from rollout.fast_decoder import FastDecoder

SLOT_BUCKET = 64  # T is rounded up to a multiple of this, so most calls reuse a captured graph


def graph_slots(max_len: int) -> int:
    """T = ceil(max_len / SLOT_BUCKET) * SLOT_BUCKET."""
    return -(-max_len // SLOT_BUCKET) * SLOT_BUCKET


class GraphedDecode:
    """A KV cache [L, B, kvh, T, d] with static input buffers, and the decode step over it
    captured once as a CUDA graph (or, with ``capture=False``, run eagerly: the same static
    code path, for CPU tests)."""

    def __init__(self, fast: FastDecoder, batch: int, slots: int, capture: bool = True,
                 pool=None) -> None:
        self.fast, self.slots = fast, slots
        dev = fast.device
        self.cache = fast.new_cache(batch, slots)
        self.ids = torch.zeros((batch, 1), dtype=torch.long, device=dev)
        self.positions = torch.zeros((batch, 1), dtype=torch.long, device=dev)
        self.key_valid = torch.ones((batch, slots), dtype=torch.bool, device=dev)
        self.start = torch.zeros(1, dtype=torch.long, device=dev)
        fast.ensure_rope(slots)
        self.graph = None
        self.logits = None
        if capture:
            self._capture(pool)

    def _run(self) -> torch.Tensor:
        return self.fast.decode_static(self.ids, self.positions, self.key_valid, self.cache,
                                       self.start)

    def _capture(self, pool) -> None:
        # warm-up on a side stream first (cuBLAS handles and workspaces exist before capture)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._run()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = self._run()

    def begin(self, key_valid: torch.Tensor) -> None:
        """A new generation: its real-slot mask [B, <=T] (slots past it count as real: they
        are only ever attended once written)."""
        self.key_valid.fill_(True)
        self.key_valid[:, :key_valid.shape[1]].copy_(key_valid)

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The prompt, eagerly (its width varies): cache slots 0..S-1."""
        width = ids.shape[1]
        return self.fast.forward(ids, positions, self.key_valid[:, :width], self.cache, 0)

    def decode(self, ids: torch.Tensor, positions: torch.Tensor, start: int) -> torch.Tensor:
        """One token per row at cache slot ``start``; the logits [B, vocab] are the graph's
        output buffer, overwritten by the next step."""
        self.ids.copy_(ids)
        self.positions.copy_(positions)
        self.start.fill_(start)
        if self.graph is None:
            return self._run()
        self.graph.replay()
        return self.logits
