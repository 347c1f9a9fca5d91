"""Text rewards: exact match and token-level F1 (SQuAD-style normalization)."""

from __future__ import annotations

import re
import string
from collections import Counter


def normalize_text(text: str) -> str:
    """Lower-case, drop punctuation and the articles a/an/the, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1_score(prediction: str, reference: str) -> float:
    """F1 = 2PR / (P + R) over the bags of normalized tokens; 1.0 when both are empty."""
    pred, ref = normalize_text(prediction).split(), normalize_text(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def exact_answer_reward(response: str, label: str) -> float:
    """1.0 if the response (whitespace stripped) equals the label, else 0.0."""
    return 1.0 if response.strip() == str(label).strip() else 0.0
