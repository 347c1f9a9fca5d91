"""Async mode's weight hand-off (infra.sides.pack_weights / unpack_weights): what the rollout
side loads is the training side's state dict, bit for bit, whatever the dtype and shape."""

from __future__ import annotations

import pickle

import torch

from infra.sides import pack_weights, unpack_weights


def test_packed_weights_come_back_bit_for_bit_through_a_pipe():
    weights = {"w": torch.randn(3, 4), "bf16": torch.randn(5).to(torch.bfloat16),
               "scalar": torch.tensor(3.5), "empty": torch.empty(0, 4),
               "ints": torch.arange(6, dtype=torch.int64).reshape(2, 3),
               "strided": torch.randn(4, 6)[:, ::2]}  # not contiguous
    weights["tied"] = weights["w"]
    # through pickle, as multiprocessing's queue sends it
    back = unpack_weights(pickle.loads(pickle.dumps(pack_weights(weights))))
    assert set(back) == set(weights)
    for name, tensor in weights.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape, name
        assert torch.equal(back[name], tensor), name
    back["w"] += 1  # tensors of their own: the engine may copy them in or keep them
    assert not torch.equal(back["w"], weights["w"])
