"""Vocabulary-chunked log-probs and entropy equal the full computation, values and gradients."""

from __future__ import annotations

import pytest
import torch

from tests.trainer_fixtures import build_model, make_batch
from trainers import algorithms as alg
from trainers.base import pad_batch
from trainers.logprobs import chunked_logprobs, linear_head
from trainers.torch_trainer import response_logprobs

torch.set_num_threads(1)


def full_reference(h, w, targets, temperature):
    z = (h @ w.t()) / temperature
    logp = torch.log_softmax(z, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    return logp, alg.entropy_from_logits(z)


@pytest.mark.parametrize("chunk", [1, 7, 53, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_full_in_float64(chunk, temperature):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 5, 16, generator=g, dtype=torch.float64)
    w = torch.randn(53, 16, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 53, (3, 5), generator=g)
    a, b = torch.randn(3, 5, generator=g, dtype=torch.float64), torch.randn(3, 5, generator=g,
                                                                            dtype=torch.float64)
    grads = []
    for fn in (full_reference, lambda *x: chunked_logprobs(*x, chunk=chunk)):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        logp, ent = fn(hh, ww, targets, temperature)
        ((a * logp).sum() + (b * ent).sum()).backward()
        grads.append((logp.detach(), ent.detach(), hh.grad, ww.grad))
    for want, got in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(got.double(), want, atol=1e-10, rtol=1e-10)


def test_chunked_gradcheck():
    """The hand-written backward against finite differences (float64)."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 6, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (4,), generator=g)
    assert torch.autograd.gradcheck(lambda hh, ww: chunked_logprobs(hh, ww, targets, 0.9, 4),
                                    (h, w))


def test_detached_entropy_leaves_logprob_gradient_alone():
    g = torch.Generator().manual_seed(2)
    h = torch.randn(7, 8, generator=g, requires_grad=True)
    w = torch.randn(30, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, 30, (7,), generator=g)
    logp, ent = chunked_logprobs(h, w, targets, 1.0, chunk=8)
    assert not ent.detach().requires_grad
    (logp.sum() + ent.detach().sum()).backward()
    want_h, want_w = torch.autograd.grad(full_reference(h, w, targets, 1.0)[0].sum(), (h, w))
    torch.testing.assert_close(h.grad, want_h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad, want_w, atol=1e-5, rtol=1e-5)


def test_response_logprobs_chunked_equals_full_logits_path(tmp_path):
    """The trainer's chunked path (hidden states -> head in vocabulary chunks, tied embedding)
    gives the full-logits path's log-probs, entropy and parameter gradients."""
    from infra.modeling import load_model

    model = load_model(build_model(tmp_path))
    assert linear_head(model) is not None
    pb = pad_batch(make_batch([1.0, 0.0, 1.0, 0.0], seed=3), 0)
    out = {}
    for chunk in (None, 5):
        model.zero_grad(set_to_none=True)
        logp, ent = response_logprobs(model, pb, 0.8, with_entropy=True, vocab_chunk_size=chunk)
        ((logp * pb.mask).sum() + 0.3 * (ent * pb.mask).sum()).backward()
        out[chunk] = (logp.detach(), ent.detach(),
                      {n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(out[5][0], out[None][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(out[5][1], out[None][1], atol=1e-5, rtol=0)
    for name, grad in out[None][2].items():
        torch.testing.assert_close(out[5][2][name], grad, atol=1e-5, rtol=1e-4, msg=name)
