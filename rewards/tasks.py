"""Built-in synthetic verifiable tasks: their problem generators and verifiers.

Each task yields prompt records ``{"prompt", "label", "metadata"}``; a fixed, seeded held-out set
is never trained on.

- ``addition``: ``"37+48="`` -> ``"85"`` (exact match).
- ``countdown``: ``"3,5,7>22:"`` (label: one solution) -> an expression using each given number exactly once with
  ``+ - * /`` and parentheses whose value is the target, e.g. ``"3*5+7"``.
"""

from __future__ import annotations

import ast
import itertools
import operator
import random
import re
import threading
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction

from rewards.text import exact_answer_reward

__all__ = ["TaskSplit", "addition_problems", "countdown_problems", "countdown_reward",
           "evaluate_expression", "exact_answer_reward", "load_task", "split_held_out"]


@dataclass(frozen=True)
class TaskSplit:
    train: list[dict]
    held_out: list[dict]


def addition_problems(lo: int = 10, hi: int = 99) -> list[dict]:
    """Every ``a+b=`` with lo <= a, b <= hi; the label is the decimal sum."""
    return [{"prompt": f"{a}+{b}=", "label": str(a + b), "metadata": {"task": "addition"}}
            for a in range(lo, hi + 1) for b in range(lo, hi + 1)]


_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def countdown_problems(lo: int = 1, hi: int = 9, max_target: int = 99) -> list[dict]:
    """Every (ordered numbers a, b, c in [lo, hi], target) reachable as ``(a o b) o c`` or
    ``a o (b o c)`` with o in {+, -, *} and 1 <= target <= max_target. The label is one solution
    (what SFT imitates; any correct expression scores 1), also in ``metadata["solution"]``.
    Deterministic order."""
    seen: set[tuple] = set()
    out = []
    for nums in itertools.product(range(lo, hi + 1), repeat=3):
        a, b, c = nums
        for o1, o2 in itertools.product(_OPS, repeat=2):
            for expr, value in ((f"({a}{o1}{b}){o2}{c}", _OPS[o2](_OPS[o1](a, b), c)),
                                (f"{a}{o1}({b}{o2}{c})", _OPS[o1](a, _OPS[o2](b, c)))):
                if 1 <= value <= max_target and (nums, value) not in seen:
                    seen.add((nums, value))
                    out.append({"prompt": f"{a},{b},{c}>{value}:", "label": expr,
                                "metadata": {"task": "countdown", "numbers": list(nums),
                                             "target": value, "solution": expr}})
    return out


_PARSE_LOCK = threading.Lock()
_ARITHMETIC = re.compile(r"[0-9+\-*/() \t]*")
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv}


def evaluate_expression(text: str) -> tuple[Fraction, list[int]]:
    """Exact value of an arithmetic expression (ints, + - * /, parentheses, unary minus) and the
    integer literals it uses. Raises ValueError for anything else (names, calls, powers, /0)."""
    if len(text) > 200:
        raise ValueError("expression too long")
    if not _ARITHMETIC.fullmatch(text):
        # only decimal digits: Python also reads 0o11, 0x9, 0b1001 and 1_0 as ints, so an answer
        # could "use" 9 without writing it (review, 2026-11-29)
        raise ValueError(f"not plain arithmetic: {text!r}")
    try:
        with _PARSE_LOCK:  # CPython 3.11's ast.parse is not thread-safe (recursion-depth SystemError)
            tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as err:
        raise ValueError(f"not an expression: {text!r}") from err
    used: list[int] = []

    def ev(node) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            return _BINOPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError(f"unsupported syntax in {text!r}")
    return ev(tree), used


def countdown_reward(response: str, label: str | None, metadata: dict) -> float:
    """1.0 if the response is an expression using exactly the given numbers (each once) whose
    exact value is the target, else 0.0."""
    numbers, target = metadata.get("numbers"), metadata.get("target")
    if numbers is None or target is None:
        raise ValueError("countdown reward needs metadata['numbers'] and metadata['target']")
    target = Fraction(int(target))
    try:
        value, used = evaluate_expression(response.strip())
    except ValueError:
        return 0.0
    return 1.0 if value == target and Counter(used) == Counter(int(n) for n in numbers) else 0.0


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


TASKS = {"addition": addition_problems, "countdown": countdown_problems}


def load_task(name: str, held_out_size: int) -> TaskSplit:
    if name not in TASKS:
        raise ValueError(f"unknown task '{name}'; built-in tasks: {sorted(TASKS)}")
    return split_held_out(TASKS[name](), held_out_size)
