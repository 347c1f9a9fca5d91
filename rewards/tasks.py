"""Built-in synthetic verifiable tasks: their problem generators and verifiers.

Each task yields prompt records ``{"prompt", "label", "metadata"}``; a fixed, seeded held-out set
is never trained on.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class TaskSplit:
    train: list[dict]
    held_out: list[dict]


def addition_problems(lo: int = 10, hi: int = 99) -> list[dict]:
    """Every ``a+b=`` with lo <= a, b <= hi; the label is the decimal sum."""
    return [{"prompt": f"{a}+{b}=", "label": str(a + b), "metadata": {"task": "addition"}}
            for a in range(lo, hi + 1) for b in range(lo, hi + 1)]


def split_held_out(problems: list[dict], held_out_size: int, seed: int = 1234) -> TaskSplit:
    """A fixed held-out set (seeded, independent of the run seed) and the rest for training."""
    if held_out_size >= len(problems):
        raise ValueError(f"held_out_size={held_out_size} leaves nothing to train on "
                         f"({len(problems)} problems)")
    order = list(range(len(problems)))
    random.Random(seed).shuffle(order)
    held = set(order[:held_out_size])
    return TaskSplit(train=[p for i, p in enumerate(problems) if i not in held],
                     held_out=[problems[i] for i in order[:held_out_size]])


def exact_answer_reward(response: str, label: str) -> float:
    """1.0 if the response (whitespace stripped) equals the label, else 0.0."""
    return 1.0 if response.strip() == str(label).strip() else 0.0


TASKS = {"addition": addition_problems}


def load_task(name: str, held_out_size: int) -> TaskSplit:
    if name not in TASKS:
        raise ValueError(f"unknown task '{name}'; built-in tasks: {sorted(TASKS)}")
    return split_held_out(TASKS[name](), held_out_size)
