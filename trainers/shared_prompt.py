"""The training forward with each group's prompt computed once (GRPO's n samples share it).

A rollout batch holds ``n_samples_per_prompt`` responses per prompt. The plain forward runs
every row's prompt again: B x (P + R) token positions for B rows, prompts of length P and
responses of length R. Causal attention makes a prompt's keys and values the same in every row
that holds it, so they are computed once per distinct prompt (U of them) and shared:

    prompt pass:    U x P positions        -> K, V of the prompts, h_last (the last prompt position)
    response pass:  B x (R - 1) positions  attending to [K, V of its prompt ; its own]

The hidden state that predicts response token t is h_last for t = 0 and the response pass's
position t - 1 after that; the last response token is only a target, so the response pass
stops before it. Gradients flow through the shared K, V (``index_select`` is differentiable),
so loss and gradient equal the plain forward's up to float rounding. The quickstart (P = 7,
R = 4 with its EOS, 8 samples per prompt) trains on 32 x 7 + 256 x 3 = 992 positions instead
of 256 x 11 = 2816.

Prompts are left-padded to a common length so every response starts at the same cache offset;
position ids count real tokens only, as in the plain right-padded forward.
"""

from __future__ import annotations

import torch

from trainers.base import PaddedBatch

# share only when it saves at least this share of the token positions
MIN_SAVING = 0.2


def can_share_prompt(model: torch.nn.Module) -> bool:
    """A model whose decoder (``model.base_model``: the model itself for an HF base model)
    takes a ``DynamicCache``, every layer full attention (a sliding window would crop the
    shared keys), and no activation checkpointing (HF turns the cache off under it). Not on
    CUDA under deterministic algorithms: the shared rows' gradients are summed with
    ``index_add_``, which CUDA does not promise to order."""
    decoder = getattr(model, "base_model", None)
    config = getattr(decoder, "config", None)
    if config is None:
        return False
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    on_cuda = any(p.is_cuda for p in decoder.parameters())
    return (not _checkpointing(decoder)
            and not (on_cuda and torch.are_deterministic_algorithms_enabled())
            and all(t == "full_attention" for t in layer_types))


def response_hidden(decoder: torch.nn.Module, pb: PaddedBatch, share_prompt: bool) -> torch.Tensor:
    """[B, T, H] final hidden states of ``decoder`` (an HF base model) at the positions
    predicting the response tokens: each prompt run once when ``share_prompt`` and it pays
    (``worth_sharing``), else the plain forward gathered at ``response_index``."""
    if share_prompt and can_share_prompt(decoder):
        groups = prompt_groups(pb.input_ids, pb.prompt_len)
        if worth_sharing(pb, groups):
            return response_hidden_shared(decoder, pb, groups)
    hidden = decoder(input_ids=pb.input_ids, attention_mask=pb.attention_mask).last_hidden_state
    return hidden.gather(1, pb.response_index[..., None].expand(-1, -1, hidden.shape[-1]))


def new_cache(base_model: torch.nn.Module):
    """An empty KV cache for ``base_model``: its own kind (infra.qwen2) or HF's DynamicCache."""
    if hasattr(base_model, "new_cache"):
        return base_model.new_cache()
    from transformers import DynamicCache

    return DynamicCache(config=base_model.config)


def _checkpointing(model: torch.nn.Module) -> bool:
    """HF's activation-checkpointing flag (``is_gradient_checkpointing`` before transformers 5)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def prompt_groups(input_ids: torch.Tensor, prompt_len: torch.Tensor) -> torch.Tensor:
    """group[i] = index of row i's prompt among the distinct prompts, consecutive rows with the
    same prompt (same length, same tokens) sharing one: [B] long, 0 .. U-1, non-decreasing."""
    width = int(prompt_len.max())
    positions = torch.arange(width, device=input_ids.device)
    prompts = torch.where(positions < prompt_len[:, None], input_ids[:, :width], -1)
    new = torch.ones(len(prompt_len), dtype=torch.bool, device=input_ids.device)
    new[1:] = (prompts[1:] != prompts[:-1]).any(dim=-1)
    return torch.cumsum(new.long(), dim=0) - 1


def worth_sharing(pb: PaddedBatch, groups: torch.Tensor) -> bool:
    """True when U x P + B x (R - 1) positions are at most (1 - MIN_SAVING) x B x (P + R)."""
    rows = len(groups)
    distinct = int(groups[-1]) + 1
    shared = distinct * int(pb.prompt_len.max()) + rows * (pb.response_ids.shape[1] - 1)
    return distinct < rows and shared <= (1 - MIN_SAVING) * rows * pb.input_ids.shape[1]


def left_padded_prompts(pb: PaddedBatch, first_rows: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, position_ids) [U, P] of the distinct prompts (rows
    ``first_rows``), left-padded to P = the longest: token j of a prompt of length p sits at
    column P - p + j, with position id j. Padding is token 0, masked out of attention."""
    lengths = pb.prompt_len[first_rows]
    width = int(lengths.max())
    columns = torch.arange(width, device=lengths.device)
    source = columns[None, :] - (width - lengths[:, None])        # j, negative on padding
    real = source >= 0
    ids = pb.input_ids[first_rows].gather(1, source.clamp(min=0))
    ids = torch.where(real, ids, torch.zeros_like(ids))
    return ids, real.long(), source.clamp(min=0)


def response_hidden_shared(base_model: torch.nn.Module, pb: PaddedBatch, groups: torch.Tensor
                           ) -> torch.Tensor:
    """[B, R, H] final hidden states predicting each response token (as the plain forward's
    ``last_hidden_state`` gathered at ``response_index``), the prompts run once per group."""
    rows = len(groups)
    first_rows = torch.ones(rows, dtype=torch.bool, device=groups.device)
    first_rows[1:] = groups[1:] != groups[:-1]
    first_rows = first_rows.nonzero().squeeze(-1)
    ids, prompt_mask, prompt_pos = left_padded_prompts(pb, first_rows)
    cache = new_cache(base_model)
    prompt_out = base_model(input_ids=ids, attention_mask=prompt_mask, position_ids=prompt_pos,
                            past_key_values=cache, use_cache=True)
    cache.reorder_cache(groups)  # each row gets its prompt's keys and values (differentiable)
    last_prompt = prompt_out.last_hidden_state[:, -1][groups][:, None]
    # the last response token is only a target: its hidden state would predict nothing
    width = pb.response_ids.shape[1] - 1
    if width == 0:
        return last_prompt
    steps = torch.arange(width, device=groups.device)
    response_len = pb.attention_mask.sum(dim=-1) - pb.prompt_len
    response_mask = (steps[None, :] < response_len[:, None]).long()
    response_out = base_model(
        input_ids=pb.response_ids[:, :width], position_ids=pb.prompt_len[:, None] + steps[None, :],
        attention_mask=torch.cat([prompt_mask[groups], response_mask], dim=-1),
        past_key_values=cache, use_cache=True)
    return torch.cat([last_prompt, response_out.last_hidden_state], dim=1)
