"""infra/tokenizer.py: a tokenizer seen before loads from rlake's cache without transformers,
giving transformers' ids and text; tokenizers that do more than their backend never do."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from infra import tokenizer as tokenizer_cache
from infra.config import TinyModelConfig
from infra.modeling import build_char_tokenizer, build_tiny_model, load_tokenizer

SHAPE = TinyModelConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                        num_key_value_heads=1, intermediate_size=32, max_position_embeddings=32)


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RLAKE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tokenizers"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tok") / "tiny", SHAPE))


def test_the_second_load_is_cached_and_answers_as_transformers(folder, cache):
    first, second = load_tokenizer(folder), load_tokenizer(folder)
    assert not isinstance(first, tokenizer_cache.PlainTokenizer)
    assert isinstance(second, tokenizer_cache.PlainTokenizer)
    assert len(list(cache.iterdir())) == 1
    reference = AutoTokenizer.from_pretrained(folder)
    assert (second.bos_token_id, second.eos_token_id, second.pad_token_id) == (
        reference.bos_token_id, reference.eos_token_id, reference.pad_token_id)
    assert len(second) == len(reference)
    rng = random.Random(0)
    alphabet = "0123456789+-*/=()., :<>[]abcxyzAZ\n\té" + "<s></s><pad>"
    texts = ["37+48=", "a b", " 12 ", "<s>1+1</s>", ""] + [
        "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))) for _ in range(200)]
    for text in texts:
        for special in (True, False):
            assert second(text, add_special_tokens=special)["input_ids"] == \
                reference(text, add_special_tokens=special)["input_ids"], (text, special)
    for _ in range(200):
        ids = [rng.randrange(len(reference)) for _ in range(rng.randint(0, 20))]
        for skip in (True, False):
            assert second.decode(ids, skip_special_tokens=skip) == \
                reference.decode(ids, skip_special_tokens=skip), (ids, skip)


def test_the_tiny_models_tokenizer_keeps_spaces_loaded_and_cached(folder, cache):
    """transformers loads a Qwen2 folder as Qwen2Tokenizer (byte-level BPE) whatever its
    tokenizer_config says; the char tokenizer is written in that form, so text with spaces
    round-trips, with the ids of the tokenizer build_tiny_model wrote."""
    built = build_char_tokenizer()
    for tokenizer in (load_tokenizer(folder), load_tokenizer(folder)):
        for text in ("a b", " 12 + 3 = 15", "(1+2) * 3 = 9", "x"):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            assert ids == built(text, add_special_tokens=False)["input_ids"], text
            assert len(ids) == len(text) and tokenizer.decode(ids) == text
    assert isinstance(tokenizer, tokenizer_cache.PlainTokenizer)


def test_changed_files_are_another_entry(folder, cache, tmp_path):
    load_tokenizer(folder)
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps(config | {"eos_token": "<pad>"}))
    assert not isinstance(load_tokenizer(other), tokenizer_cache.PlainTokenizer)
    assert load_tokenizer(other).eos_token_id == 0
    assert len(list(cache.iterdir())) == 2


def test_a_chat_template_is_never_cached(folder, cache, tmp_path):
    templated = tmp_path / "templated"
    shutil.copytree(folder, templated)
    (templated / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    for _ in range(2):
        tok = load_tokenizer(templated)
        assert not isinstance(tok, tokenizer_cache.PlainTokenizer)
        assert tok.chat_template
    assert not cache.exists() or not list(cache.iterdir())


def test_a_corrupt_entry_is_rebuilt(folder, cache):
    load_tokenizer(folder)
    entry = tokenizer_cache.cache_entry(folder)
    entry.write_text("{not json")
    assert not isinstance(load_tokenizer(folder), tokenizer_cache.PlainTokenizer)
    assert isinstance(load_tokenizer(folder), tokenizer_cache.PlainTokenizer)


def test_a_run_loading_a_seen_model_imports_no_transformers(folder, cache):
    """What a run's process loads (tokenizer and model) with the cache warm: nothing of
    transformers (its import alone is ~1.2-2 s of start-up)."""
    load_tokenizer(folder)
    code = ("import sys; from infra.modeling import load_model, load_tokenizer; "
            "load_tokenizer(sys.argv[1]); load_model(sys.argv[1]); "
            "print(sorted(m for m in sys.modules if m.startswith('transformers')))")
    out = subprocess.run([sys.executable, "-c", code, folder], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_other_calls_fall_back_to_transformers_and_it_pickles(folder, cache, tmp_path):
    """What rlake does not call itself (a custom rollout function may) is transformers'."""
    import pickle

    load_tokenizer(folder)
    tok = load_tokenizer(folder)
    reference = AutoTokenizer.from_pretrained(folder)
    assert tok.convert_tokens_to_ids(["1", "+", "</s>"]) == \
        reference.convert_tokens_to_ids(["1", "+", "</s>"])
    assert tok.convert_tokens_to_ids("no-such-token") == \
        reference.convert_tokens_to_ids("no-such-token")
    assert tok.batch_decode([[5, 6], [7]]) == reference.batch_decode([[5, 6], [7]])
    tok.save_pretrained(tmp_path / "saved")
    assert AutoTokenizer.from_pretrained(tmp_path / "saved")("12")["input_ids"] == \
        reference("12")["input_ids"]
    copy = pickle.loads(pickle.dumps(load_tokenizer(folder)))
    assert copy("37+48=")["input_ids"] == reference("37+48=")["input_ids"]


@pytest.mark.parametrize("load", ["built", "cached"])
def test_a_tokenizer_without_a_pad_token_pads_with_eos_and_one_missing_is_named(folder, cache, tmp_path, load):
    """Review (2026-11-29): without a pad token the run padded with id 55 of a 55-token model
    (an index error after the first evaluation); without tokenizer files it failed in torch."""
    from infra.config import ConfigError

    nopad = tmp_path / "nopad"
    shutil.copytree(folder, nopad)
    config = json.loads((nopad / "tokenizer_config.json").read_text())
    config.pop("pad_token", None)
    (nopad / "tokenizer_config.json").write_text(json.dumps(config))
    if load == "cached":
        load_tokenizer(nopad)
    tok = load_tokenizer(nopad)
    assert isinstance(tok, tokenizer_cache.PlainTokenizer) == (load == "cached")
    vocab = json.loads((nopad / "config.json").read_text())["vocab_size"]
    assert tok.eos_token_id is not None and tok.pad_token_id == tok.eos_token_id < vocab
    assert load_tokenizer(folder).pad_token_id != tok.eos_token_id  # the original keeps its pad
    empty = tmp_path / "notok"
    empty.mkdir()
    shutil.copy(nopad / "config.json", empty / "config.json")
    with pytest.raises(ConfigError, match="has no tokenizer"):
        load_tokenizer(empty)
