"""``pad_batch`` fills its tensors from the rows' tokens laid end to end; this checks it row by row
against the plain per-row definition, on ragged random batches (empty responses, empty or longer
loss masks, missing, short and long rollout log-probs), and its two refusals."""

import random

import pytest
import torch

from trainers.base import TrainBatch, pad_batch


def reference(batch: TrainBatch, pad_id: int) -> dict[str, list]:
    """The definition, one row at a time (response token t of row i predicted at len(prompt_i) - 1 + t)."""
    width = max(len(p) + len(r) for p, r in zip(batch.prompt_token_ids, batch.response_token_ids,
                                                    strict=True))
    resp_width = max(1, max(len(r) for r in batch.response_token_ids))
    out = {k: [] for k in ("input_ids", "attention_mask", "response_index", "response_ids", "mask",
                           "rollout_logprobs", "has_rollout_logprobs", "prompt_len")}
    for p, r, m, lp in zip(batch.prompt_token_ids, batch.response_token_ids, batch.loss_mask,
                           batch.rollout_logprobs, strict=True):
        pad, tail = width - len(p) - len(r), resp_width - len(r)
        out["input_ids"].append(p + r + [pad_id] * pad)
        out["attention_mask"].append([1] * (len(p) + len(r)) + [0] * pad)
        out["response_index"].append([len(p) - 1 + t for t in range(len(r))] + [0] * tail)
        out["response_ids"].append(r + [0] * tail)
        out["mask"].append((m[:len(r)] if m else [1] * len(r)) + [0] * tail)
        kept = lp[:len(r)]
        out["rollout_logprobs"].append(kept + [0.0] * (resp_width - len(kept)))
        out["has_rollout_logprobs"].append(1.0 if kept else 0.0)
        out["prompt_len"].append(len(p))
    return out


def random_batch(rng: random.Random) -> TrainBatch:
    n = rng.randint(1, 9)
    prompts = [[rng.randrange(50) for _ in range(rng.randint(1, 5))] for _ in range(n)]
    responses = [[rng.randrange(50) for _ in range(rng.choice([0, 1, 2, 3, 6]))] for _ in range(n)]
    masks = [rng.choice([[], [rng.randint(0, 1) for _ in range(len(r) + rng.randint(0, 2))]])
             for r in responses]
    logprobs = [rng.choice([[], [rng.random() - 2 for _ in range(rng.randint(0, len(r) + 2))]])
                for r in responses]
    return TrainBatch([f"u{i}" for i in range(n)], prompts, responses, masks, logprobs,
                      [0.0] * n, ["g"] * n, [0] * n)


def test_pad_batch_matches_the_per_row_definition_on_ragged_batches():
    rng = random.Random(0)
    for _ in range(300):
        batch = random_batch(rng)
        padded, expected = pad_batch(batch, pad_id=7), reference(batch, pad_id=7)
        for name, rows in expected.items():
            got = getattr(padded, name)
            want = torch.tensor(rows, dtype=got.dtype)
            assert got.dtype == (torch.float32 if name in ("mask", "rollout_logprobs",
                                                           "has_rollout_logprobs") else torch.long)
            assert torch.equal(got, want), (name, batch)


@pytest.mark.parametrize("change, message", [
    ({"prompt_token_ids": [[1], []]}, "sample u1: empty prompt_token_ids"),
    ({"loss_mask": [[], [1]]}, "sample u1: loss_mask has 1 entries for 2 response tokens"),
])
def test_pad_batch_names_the_sample_it_refuses(change, message):
    fields = {"sample_uids": ["u0", "u1"], "prompt_token_ids": [[1], [2]],
              "response_token_ids": [[1, 2], [3, 4]], "loss_mask": [[], []],
              "rollout_logprobs": [[], []], "rewards": [0.0, 0.0], "group_keys": ["g", "g"],
              "weight_versions": [0, 0]}
    with pytest.raises(ValueError, match=message):
        pad_batch(TrainBatch(**{**fields, **change}), 0)
