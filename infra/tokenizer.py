"""Tokenizer loading that imports transformers only the first time a tokenizer is seen.

``import transformers`` alone is ~1.2-2 s of CPU (it indexes every model it ships) in each
run's process before its first iteration. Yet for most tokenizers what rlake calls does no
Python work of transformers' own: encoding is the ``tokenizers`` backend's ``encode``, decoding
its ``decode``. So the first load of a folder goes through ``AutoTokenizer`` (the class it picks
from config.json, e.g. Qwen2Tokenizer, may rebuild the backend's pre-tokenizer and decoder) and,
when the result is such a tokenizer, keeps the backend it built in rlake's cache:

    {cache}/tokenizers/<sha256 of the folder's tokenizer files + config.json + transformers version>.json

Later loads of the same files build ``PlainTokenizer`` from that entry: the same backend, the
same token ids and text, without transformers (tested against it). A tokenizer with a chat
template, decode-time space clean-up, or a class that overrides encoding or decoding in Python
is never cached: it always comes from transformers.
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata
from pathlib import Path
from typing import Any

from infra.db_template import cache_dir
from infra.paths import write_text_atomic

# what AutoTokenizer reads (config.json: it picks the tokenizer class from the model type)
SOURCE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "added_tokens.json", "chat_template.jinja", "chat_template.json", "vocab.json",
                "merges.txt", "tokenizer.model", "config.json")
# a folder with none of these has no tokenizer (AutoTokenizer then failed far from the cause)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def missing_tokenizer(folder: str | Path) -> str | None:
    """Why ``folder`` (``model.path``) has no tokenizer, or None when it has one of
    ``TOKENIZER_FILES``."""
    if any((Path(folder) / name).is_file() for name in TOKENIZER_FILES):
        return None
    return f"model.path '{folder}' has no tokenizer (none of {', '.join(TOKENIZER_FILES)})"
# the calls rlake makes, which must be the backend's own in a cached tokenizer's class
BACKEND_METHODS = ("__call__", "encode", "decode", "_decode", "_encode_plus",
                   "convert_tokens_to_ids")


def cache_entry(folder: str | Path) -> Path:
    """The cache file for ``folder``'s tokenizer files under the installed transformers."""
    digest = hashlib.sha256()
    try:
        digest.update(metadata.version("transformers").encode())
    except metadata.PackageNotFoundError:
        pass
    for name in SOURCE_FILES:
        file = Path(folder) / name
        if file.is_file():
            digest.update(f"\0{name}\0".encode())
            digest.update(file.read_bytes())
    return cache_dir() / "tokenizers" / f"{digest.hexdigest()}.json"


class PlainTokenizer:
    """A ``tokenizers.Tokenizer`` with the special-token ids: the calls rlake makes, answered
    as transformers' tokenizer that built it answers them. Any other attribute (a custom
    rollout function's ``batch_decode``, ``save_pretrained``...) comes from transformers'
    tokenizer of ``source``, loaded on first use."""

    chat_template = None

    def __init__(self, source: str | Path, backend: str, bos_token_id: int | None,
                 eos_token_id: int | None, pad_token_id: int | None) -> None:
        from tokenizers import Tokenizer

        self.source = str(source)
        self.backend = Tokenizer.from_str(backend)
        # as transformers sets the backend before each plain call (no padding, no truncation,
        # special tokens in the text recognised as such)
        self.backend.no_truncation()
        self.backend.no_padding()
        self.backend.encode_special_tokens = False
        self.bos_token_id, self.eos_token_id, self.pad_token_id = (
            bos_token_id, eos_token_id, pad_token_id)
        self._transformers = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | list[int]:
        ids = [self.backend.token_to_id(t) for t in ([tokens] if isinstance(tokens, str) else tokens)]
        if None in ids:  # unknown token: transformers' answer (its unk id)
            return self.full().convert_tokens_to_ids(tokens)
        return ids[0] if isinstance(tokens, str) else ids

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def full(self) -> Any:
        """transformers' tokenizer of ``source`` (imports transformers)."""
        if self._transformers is None:
            from transformers import AutoTokenizer

            self._transformers = AutoTokenizer.from_pretrained(self.source)
        return self._transformers

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("source", "backend", "_transformers"):
            raise AttributeError(name)  # pickling and a half-built object: no fallback
        return getattr(self.full(), name)


def cacheable(tokenizer: Any) -> bool:
    """A transformers tokenizer whose encode/decode are its backend's: no chat template, no
    space clean-up, nothing overridden in Python."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    cls = type(tokenizer)
    return (isinstance(tokenizer, TokenizersBackend)
            and not getattr(tokenizer, "chat_template", None)
            and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
            and not getattr(tokenizer, "split_special_tokens", False)
            and all(getattr(cls, m, None) is getattr(TokenizersBackend, m) for m in BACKEND_METHODS))


def save_entry(entry: Path, tokenizer: Any) -> None:
    """Write ``tokenizer``'s backend and ids to ``entry`` (temporary name, then one rename)."""
    write_text_atomic(entry, json.dumps({
        "backend": tokenizer.backend_tokenizer.to_str(),
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id}))


def load_tokenizer(folder: str | Path) -> Any:
    """``folder``'s tokenizer: a ``PlainTokenizer`` from the cache when this exact tokenizer was
    loaded before and qualified, else transformers' (cached for next time when it qualifies)."""
    entry = cache_entry(folder)
    if entry.is_file():
        try:
            return PlainTokenizer(folder, **json.loads(entry.read_text()))
        except Exception:  # an unreadable entry (tokenizers raises plain Exception): rebuilt
            pass
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if cacheable(tokenizer):
        try:
            save_entry(entry, tokenizer)
        except OSError:
            pass  # a read-only cache only costs the next run the import
    return tokenizer
