"""Math answer checking: final-answer extraction (``\\boxed{}`` included) and normalization.

    extract_answer("so the answer is \\boxed{\\frac{1}{2}}")  -> "\\frac{1}{2}"
    normalize_answer("\\frac{1}{2}") -> "1/2";  answers_equal("0.5", "1/2") -> True

Numbers compare exactly as fractions (ints, decimals, ``a/b``, ``\\frac{a}{b}``, thousands
commas, a trailing ``%``), anything else as normalized strings.
"""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")
_ANSWER_IS = re.compile(r"answer(?:\s+is)?\s*[:=]?\s*(.+)", re.IGNORECASE)


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None if none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        rest = text[start:].split(None, 1)  # "\boxed 5"
        return rest[1].split()[0] if len(rest) > 1 else None
    depth = 0
    for i in range(brace, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[brace + 1:i]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer: last ``\\boxed{}``, else what follows the last "answer is", else the
    last number in the text; None when there is none."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    found = _ANSWER_IS.findall(text)
    if found:
        return found[-1].strip().rstrip(".").strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _frac_to_slash(s: str) -> str:
    """``\\frac{a}{b}`` and ``\\frac ab`` -> ``(a)/(b)`` (outer parens dropped for plain ints)."""
    s = re.sub(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}", r"\1/\2", s)
    return re.sub(r"\\[dt]?frac\s*(\d)(\d)", r"\1/\2", s)


def normalize_answer(answer: str) -> str:
    """Strip LaTeX wrappers, spaces, units of formatting: ``$``, ``\\left``/``\\right``,
    ``\\!``, ``\\text{}``, ``^\\circ``, thousands commas; ``\\frac{a}{b}`` -> ``a/b``."""
    s = answer.strip()
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    for old in ("\\left", "\\right", "\\!", "\\,", "\\;", "$", "^\\circ", "^{\\circ}", "\\%"):
        s = s.replace(old, "")
    s = _frac_to_slash(s)
    s = s.replace(" ", "").rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    if s.startswith("{") and s.endswith("}"):
        s = s[1:-1]
    return s


def to_fraction(s: str) -> Fraction | None:
    """An exact value for ``12``, ``-0.5``, ``3/4``, ``50%`` (= 1/2), ``(3)/(4)``; else None."""
    s = s.replace("(", "").replace(")", "")
    scale = Fraction(1)
    if s.endswith("%"):
        s, scale = s[:-1], Fraction(1, 100)
    if not re.fullmatch(r"-?\d+(\.\d+)?(/-?\d+(\.\d+)?)?", s):
        return None
    try:
        return Fraction(s) * scale if "/" not in s else (
            Fraction(s.split("/")[0]) / Fraction(s.split("/")[1]) * scale)
    except (ValueError, ZeroDivisionError):
        return None


def answers_equal(predicted: str, reference: str) -> bool:
    """Equal as exact numbers when both parse, else as normalized strings."""
    a, b = normalize_answer(predicted), normalize_answer(reference)
    fa, fb = to_fraction(a), to_fraction(b)
    if fa is not None and fb is not None:
        return fa == fb
    return a == b


def math_reward(response: str, label: str | None, metadata: dict) -> float:
    """1.0 when the extracted final answer equals the label (see ``answers_equal``), else 0.0."""
    if label is None:
        raise ValueError("math reward needs a label")
    answer = extract_answer(response)
    return 1.0 if answer is not None and answers_equal(answer, str(label)) else 0.0
