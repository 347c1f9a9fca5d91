"""Pure-torch stand-ins for the two ``sgl_kernel`` CPU helpers SGLang's CPU engine calls.

There is no CPU wheel of ``sgl_kernel`` (``sglang-kernel``) for this machine; with
``SGLANG_USE_CPU_ENGINE=1`` SGLang imports only these two names from it when it serves a plain
decoder (Qwen2/Llama) with the torch-native attention backend. ``scripts/setup_sglang.sh``
installs this file as the top-level module ``sgl_kernel`` inside ``.venv-sglang`` only.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

__version__ = "0.0.0+rlake.cpu"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Scatter newly allocated cache slots into the request->token table, in place.

    For request i with n_i = end_i - start_i and c_i = sum_{j<i} n_j:
    ``req_to_token[req_pool_indices[i], start_i:end_i] = out_cache_loc[c_i:c_i + n_i]``.
    """
    del pool_len  # the row length is req_to_token.shape[1]
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """Copy KV-cache slots ``src_loc -> tgt_loc`` in every layer buffer, in place.

    Buffer b starts at address ``data_ptrs[b]`` and holds one slot per ``strides[b]`` bytes:
    ``buf_b[tgt_loc[k]] = buf_b[src_loc[k]]`` for all k (all sources are read before any write,
    so overlapping moves are safe).
    """
    src = src_loc.to(torch.int64).numpy()
    tgt = tgt_loc.to(torch.int64).numpy()
    if src.size == 0:
        return
    n_slots = int(max(src.max(), tgt.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        raw = ctypes.cast(ctypes.c_void_p(int(ptr)), ctypes.POINTER(ctypes.c_uint8))
        view = np.ctypeslib.as_array(raw, shape=(n_slots, int(stride)))
        view[tgt] = view[src]


def _unavailable(name: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} has no CPU stand-in (rlake's CPU path implements only "
            "assign_req_to_token_pool_cpu and copy_all_layer_kv_cache_cpu)"
        )

    kernel.__name__ = name
    return kernel


def __getattr__(name: str):
    """Other kernels are imported at module level by SGLang but never called on the CPU path
    for a plain decoder: importing them succeeds, calling one raises NotImplementedError."""
    if name.startswith("__"):
        raise AttributeError(name)
    return _unavailable(name)
