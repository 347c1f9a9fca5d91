"""Prompt data: records ``{"prompt", "label", "metadata", "tools", "row"}`` served in seeded epochs.

Sources: a built-in task, or a JSONL / Parquet file, optionally sliced ``path@[start:end]``
(Python slice bounds over the file's rows). ``input_key`` / ``label_key`` / ``metadata_key`` /
``tool_key`` name the columns. A malformed JSONL line or a missing key is a ``ValueError``
naming the file and line (row), raised when the data is loaded, before any generation.

The data position is one integer, the number of prompts handed out so far. The order of epoch
``e`` is a permutation seeded by ``(seed, e)``, so any position can be resumed exactly from that
integer alone. Each iteration records where it stopped (``rollout/data_position_end`` in the
``train_steps`` metrics JSON); ``next_data_position`` reads it back on resume.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout.sample import SAMPLE_KEY

POSITION_METRIC = "rollout/data_position_end"
_SLICE = re.compile(r"^(?P<path>.+)@\[(?P<start>-?\d*):(?P<end>-?\d*)\]$")


@dataclass
class PromptDataset:
    records: list[dict]
    seed: int = 0
    shuffle: bool = True
    source: str = "builtin"
    skipped_too_long: int = 0

    def __post_init__(self) -> None:
        if not self.records:
            raise ValueError(f"prompt data '{self.source}' is empty"
                             + (f" ({self.skipped_too_long} prompts were longer than "
                                "rollout_max_prompt_len)" if self.skipped_too_long else ""))
        self._orders: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.records)

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.records)))
            if self.shuffle:
                random.Random(f"{self.seed}/{epoch}").shuffle(order)
            self._orders = {epoch: order}
        return self._orders[epoch]

    def take(self, position: int, count: int) -> list[tuple[int, dict]]:
        """``count`` records starting at global ``position``: [(row, record)], where row is the
        record's row in its file (``record["row"]``) or its index in ``records``."""
        out = []
        for pos in range(position, position + count):
            epoch, offset = divmod(pos, len(self.records))
            idx = self._order(epoch)[offset]
            out.append((self.records[idx].get("row", idx), self.records[idx]))
        return out


def parse_data_path(spec: str) -> tuple[str, slice]:
    """``"file.jsonl@[10:20]"`` -> ("file.jsonl", slice(10, 20)); no suffix -> slice(None)."""
    m = _SLICE.match(spec)
    if not m:
        if "@[" in spec:
            raise ValueError(f"prompt data '{spec}': bad row slice, expected 'path@[start:end]'")
        return spec, slice(None)
    as_int = lambda v: int(v) if v else None  # noqa: E731
    return m["path"], slice(as_int(m["start"]), as_int(m["end"]))


def _raw_rows(path: Path) -> list[tuple[str, Any]]:
    """[(where, row dict)]: ``where`` is ``file:line N`` (JSONL) or ``file:row N`` (Parquet)."""
    if not path.exists():
        raise ValueError(f"prompt data file not found: {path}")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # noqa: PLC0415

        return [(f"{path}:row {i}", r) for i, r in enumerate(pq.read_table(path).to_pylist())]
    if path.suffix not in (".jsonl", ".json", ".ndjson"):
        raise ValueError(f"prompt data '{path}': unsupported format (use .jsonl or .parquet)")
    rows = []
    with path.open("rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            try:
                # utf-8-sig on line 1: a byte-order mark some editors write is not JSON
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{path}:line {line_no}: not UTF-8 text (byte 0x{raw[err.start]:02x} "
                                 f"at column {err.start + 1}); prompt files must be UTF-8") from None
            if not line.strip():
                continue
            try:
                rows.append((f"{path}:line {line_no}", json.loads(line)))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:line {line_no}: malformed JSON ({err.msg})") from None
    return rows


def load_prompt_file(spec: str, input_key: str = "prompt", label_key: str | None = "label",
                     metadata_key: str | None = None, tool_key: str | None = None) -> list[dict]:
    """Records of a JSONL/Parquet prompt file (row slice applied); errors name file and line."""
    path_str, rows_slice = parse_data_path(spec)
    rows = _raw_rows(Path(path_str))
    indexed = list(enumerate(rows))[rows_slice]
    records = []
    for row, (where, raw) in indexed:
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(raw).__name__}")
        records.append(_record(where, raw, row, input_key, label_key, metadata_key, tool_key))
    if not records:
        raise ValueError(f"prompt data '{spec}' is empty")
    return records


def _record(where: str, raw: dict, row: int, input_key: str, label_key: str | None,
            metadata_key: str | None, tool_key: str | None) -> dict:
    for key in (input_key, label_key, metadata_key, tool_key):
        if key is not None and key not in raw:
            raise ValueError(f"{where}: missing key '{key}' (keys: {sorted(raw)})")
    prompt = raw[input_key]
    if not isinstance(prompt, str | list) or not prompt or (isinstance(prompt, str) and not prompt.strip()):
        raise ValueError(f"{where}: '{input_key}' must be a non-empty string or a list of messages")
    if isinstance(prompt, list):
        for i, message in enumerate(prompt, start=1):
            problem = _message_problem(message)
            if problem is not None:
                raise ValueError(f"{where}: '{input_key}' is a list, so each item must be a message "
                                 "(an object with 'role', a non-empty string, and 'content', a "
                                 "non-empty string; null or empty only with 'tool_calls'): "
                                 f"message {i} {problem}")
    metadata = raw[metadata_key] if metadata_key else {}
    if isinstance(metadata, str):
        try:
            metadata = json.loads(metadata or "{}")
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: '{metadata_key}' is a string that is not JSON ({e})") from None
    if not isinstance(metadata, dict):
        raise ValueError(f"{where}: '{metadata_key}' must be an object")
    if SAMPLE_KEY in metadata:  # to_row would overwrite it, from_row would read it as our fields
        raise ValueError(f"{where}: '{metadata_key}' has the key '{SAMPLE_KEY}', which rlake "
                         "reserves for its own sample fields in the lake; rename it")
    record = {"prompt": prompt, "label": _label_text(where, label_key, raw[label_key] if label_key else None),
              "metadata": metadata, "tools": raw[tool_key] if tool_key else None, "row": row}
    for field, key in (("prompt", input_key), ("label", label_key), ("metadata", metadata_key),
                       ("tools", tool_key)):
        _check_utf8(where, key, record[field])
    return record


def _message_problem(m: Any) -> str | None:
    """What keeps ``m`` from being a chat message a template (or the plain join) can use, or
    None. Content must be text: a list of parts (``[{"type": "text", ...}]``) or a number
    became its Python repr in the prompt, and empty content left a prompt of only the template's
    tokens (the BOS alone), which was trained on. Null (or empty) content is allowed only on an
    assistant's tool call, as OpenAI's format writes it (else it became the text "None"). A role
    must be a non-empty string: the template cannot place a message without one. The role is not
    matched against a list: a template's roles (system, user, assistant, tool, developer, ...)
    are the template's to know."""
    if not isinstance(m, dict):
        return f"is {type(m).__name__} {short_repr(m)}, not an object"
    if "role" not in m:
        return "has no 'role'"
    role = m["role"]
    if not isinstance(role, str) or not role.strip():
        return f"has 'role' {short_repr(role)}: it must be a non-empty string (user, assistant, ...)"
    if "content" not in m:
        return "has no 'content'"
    content = m["content"]
    if m.get("tool_calls") and (content is None or isinstance(content, str)):
        return None
    if content is None or content == "":
        return f"has {'null' if content is None else 'empty'} 'content' (allowed only beside 'tool_calls')"
    if isinstance(content, list):
        return ("has 'content' as a list (of parts?): rlake takes text only; give the text as "
                "one string")
    if not isinstance(content, str):
        return f"has 'content' {type(content).__name__} {short_repr(content)}: it must be a string"
    if not content.strip():
        return "has 'content' of only whitespace"
    return None


def short_repr(value: Any) -> str:
    """``repr(value)``, cut to 60 characters (a 10 MB value in an error message is no help)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _label_text(where: str, label_key: str | None, label: Any) -> str | None:
    """The label as text: a string as is, an int as its digits, anything else as JSON text (a
    list ``[3, "three"]`` was Python's repr ``[3, 'three']``). A float keeps JSON's form (3.0
    stays "3.0": 3.0 and 3 are different JSON texts, and the math rewards compare numerically);
    NaN or infinity is refused (``str`` made it "nan", which no answer equals)."""
    if label is None or isinstance(label, str):
        return label
    if type(label) is int:
        return str(label)
    try:
        return json.dumps(label, ensure_ascii=False, allow_nan=False)
    except ValueError:
        raise ValueError(f"{where}: '{label_key}' holds NaN or Infinity, not a usable label") from None


def _check_utf8(where: str, key: str, value: Any) -> None:
    """Refuse a string (or object key) that cannot be written as UTF-8: JSON's ``\\ud800`` escape
    decodes to a lone surrogate, which loads fine and then broke the tokenizer or the lake
    append mid-run, with no file or line."""
    if isinstance(value, dict):
        for k, v in value.items():
            _check_utf8(where, key, k)
            _check_utf8(where, key, v)
    elif isinstance(value, list):
        for v in value:
            _check_utf8(where, key, v)
    elif isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(f"{where}: '{key}' is not valid UTF-8 text (lone surrogate "
                             f"{value[err.start]!r} at character {err.start + 1}); prompt files "
                             "must be UTF-8") from None


def render_prompt(tokenizer, prompt: str | list[dict], apply_chat_template: bool,
                  tools: list | None = None) -> str:
    """The prompt text given to the engine: the tokenizer's chat template (generation prompt
    added) when asked and the tokenizer has one; otherwise the text itself, or the messages'
    contents joined by newlines."""
    if apply_chat_template and getattr(tokenizer, "chat_template", None):
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=True)
    if isinstance(prompt, list):
        return "\n".join(str(m.get("content") or "") for m in prompt)  # null: a tool call's message
    return prompt


def drop_long_prompts(records: list[dict], tokenizer, max_len: int | None,
                      apply_chat_template: bool) -> tuple[list[dict], int]:
    """(records whose rendered prompt has <= max_len tokens, number skipped)."""
    if max_len is None:
        return records, 0
    kept = [r for r in records
            if len(tokenizer(render_prompt(tokenizer, r["prompt"], apply_chat_template, r.get("tools")),
                             add_special_tokens=False)["input_ids"]) <= max_len]
    return kept, len(records) - len(kept)


def prompt_tokens_over(tokenizer, text: str, limit: int) -> int | None:
    """The token count of ``text`` if it is over ``limit`` (a lower bound for a huge text), else
    None. Cheap for short texts: a text of at most ``limit`` UTF-8 bytes cannot have more tokens
    (every token covers at least one byte); a huge one is judged on a prefix first, so a 10 MB
    line costs one bounded tokenizer call, not a hang."""
    if len(text.encode("utf-8", errors="replace")) <= limit:
        return None
    for part in (text[:limit * 16], text):
        n = len(tokenizer(part, add_special_tokens=False)["input_ids"])
        if n > limit:
            return n
        if len(part) == len(text):
            return None
    return None


def locate(source: str, row: int) -> str:
    """``file:line N`` (or ``file:row N``) of row ``row`` of a prompt file; ``source: record N``
    for built-in data. Reads the file again: only errors need it."""
    path = Path(parse_data_path(source)[0])
    if source.startswith("builtin:") or not path.exists():
        return f"{source}: record {row}"
    return _raw_rows(path)[row][0]


def check_prompt_lengths(records: list[dict], tokenizer, limit: int, apply_chat_template: bool,
                         source: str) -> None:
    """A ValueError naming the file and line of the first prompt over ``limit`` tokens."""
    for i, rec in enumerate(records):
        text = render_prompt(tokenizer, rec["prompt"], apply_chat_template, rec.get("tools"))
        n = prompt_tokens_over(tokenizer, text, limit)
        if n is not None:
            where = locate(source, rec.get("row", i))
            raise ValueError(f"{where}: prompt has {'at least ' if len(text) > limit * 16 else ''}"
                             f"{n} tokens, more than data.max_prompt_tokens={limit} (default: the "
                             "model's context less rollout_max_response_len); set "
                             "data.rollout_max_prompt_len to skip long prompts instead")


def next_data_position(lake, run_id: str, per_iteration: int | None = None) -> int:
    """Where the next iteration's prompts start: ``rollout/data_position_end`` of the run's last
    recorded train step; for steps written without it, ``(iteration + 1) * per_iteration``; 0 for
    a run with no steps."""
    steps = lake.read("train_steps", run_id=run_id, columns=["iteration", "metrics"]).to_pylist()
    steps = [s for s in steps if s["iteration"] is not None]
    if not steps:
        return 0
    last = max(steps, key=lambda s: s["iteration"])
    metrics = json.loads(last["metrics"] or "{}")
    if POSITION_METRIC in metrics:
        return int(metrics[POSITION_METRIC])
    if per_iteration is None:
        raise ValueError(f"run {run_id}: train step {last['iteration']} has no {POSITION_METRIC}")
    return (last["iteration"] + 1) * per_iteration


def check_sft_labels(cfg, records: list[dict], source: str) -> None:
    """The SFT warm-up trains on each row's label as the response: a row without one (a null
    label, allowed for a custom reward) was trained as the text "None". Refused before a new
    run is recorded (``infra.startup.check_data``), naming the row, while the warm-up is on; a
    resume is not refused (its warm-up may be long done)."""
    if not (cfg.sft.enabled and cfg.sft.steps > 0):
        return
    for i, rec in enumerate(records):
        if rec.get("label") is None:
            key = cfg.data.label_key
            what = f"a null '{key}'" if key else "no label (data.label_key is null)"
            raise ValueError(f"{locate(source, rec.get('row', i))}: {what}, and the SFT warm-up "
                             "trains on labels; give every row a label, or set sft.enabled=false")
