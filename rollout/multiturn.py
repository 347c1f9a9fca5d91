"""Multi-turn responses: model turns and tool outputs assembled into one response with a mask.

A multi-turn sample's response is the concatenation of its turns. Tokens the model generated
are trained on (loss_mask 1, their rollout log-probs kept); tokens a tool (or the environment)
inserted are context only (loss_mask 0, log-prob 0.0).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Turn:
    token_ids: list[int]
    logprobs: list[float] | None  # None for tool output
    from_model: bool


def model_turn(token_ids: list[int], logprobs: list[float]) -> Turn:
    if len(token_ids) != len(logprobs):
        raise ValueError(f"model turn: {len(token_ids)} tokens but {len(logprobs)} log-probs")
    return Turn(list(token_ids), list(logprobs), True)


def tool_turn(token_ids: list[int]) -> Turn:
    return Turn(list(token_ids), None, False)


def assemble_turns(turns: list[Turn]) -> tuple[list[int], list[float], list[int]]:
    """(token_ids, logprobs, loss_mask) of the whole response: concatenation of the turns, mask
    1 and the model's log-probs on model tokens, mask 0 and log-prob 0.0 on tool tokens."""
    ids: list[int] = []
    logprobs: list[float] = []
    mask: list[int] = []
    for turn in turns:
        ids += turn.token_ids
        logprobs += turn.logprobs if turn.from_model else [0.0] * len(turn.token_ids)
        mask += [1 if turn.from_model else 0] * len(turn.token_ids)
    return ids, logprobs, mask


def split_by_mask(token_ids: list[int], loss_mask: list[int]) -> list[tuple[int, list[int]]]:
    """Runs of equal mask: [(mask value, tokens)], the inverse of ``assemble_turns`` for reading."""
    runs: list[tuple[int, list[int]]] = []
    for tok, m in zip(token_ids, loss_mask, strict=True):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(tok)
        else:
            runs.append((m, [tok]))
    return runs
