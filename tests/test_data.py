"""Prompt data: JSONL/Parquet, slicing, keys, errors, chat template, long prompts, position."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from buffer import Lake
from infra.config import ConfigError, load_config
from infra.modeling import build_char_tokenizer
from rollout.data import (
    POSITION_METRIC,
    PromptDataset,
    drop_long_prompts,
    load_prompt_file,
    next_data_position,
    parse_data_path,
    render_prompt,
)
from rollout.setup import load_run_data


def _write_jsonl(path, rows, raw_lines=()):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(raw_lines))
    return path


@pytest.fixture
def jsonl(tmp_path):
    rows = [{"question": f"{i}+1=", "answer": i + 1, "meta": {"i": i}, "tools": [{"name": "calc"}]}
            for i in range(10)]
    return _write_jsonl(tmp_path / "p.jsonl", rows)


def test_parse_data_path():
    assert parse_data_path("a/b.jsonl") == ("a/b.jsonl", slice(None))
    assert parse_data_path("x.parquet@[10:20]") == ("x.parquet", slice(10, 20))
    assert parse_data_path("x.jsonl@[:5]") == ("x.jsonl", slice(None, 5))
    assert parse_data_path("x.jsonl@[-3:]") == ("x.jsonl", slice(-3, None))
    with pytest.raises(ValueError, match="bad row slice"):
        parse_data_path("x.jsonl@[a:b]")


def test_jsonl_keys_and_slice(jsonl):
    recs = load_prompt_file(f"{jsonl}@[2:5]", "question", "answer", "meta", "tools")
    assert [r["prompt"] for r in recs] == ["2+1=", "3+1=", "4+1="]
    assert [r["label"] for r in recs] == ["3", "4", "5"] and [r["row"] for r in recs] == [2, 3, 4]
    assert recs[0]["metadata"] == {"i": 2} and recs[0]["tools"] == [{"name": "calc"}]


def test_parquet_matches_jsonl(tmp_path, jsonl):
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    a = load_prompt_file(f"{tmp_path / 'p.parquet'}@[-2:]", "question", "answer", "meta")
    b = load_prompt_file(f"{jsonl}@[8:10]", "question", "answer", "meta")
    assert a == b


def test_line_numbers_count_blank_lines(tmp_path):
    """The line named is the file's, blank lines counted (mutation review, 2026-11-29: counting
    only non-blank rows failed no test)."""
    (tmp_path / "gap.jsonl").write_text('{"prompt": "a", "label": "1"}\n\n   \n{bad\n')
    with pytest.raises(ValueError, match=r"gap.jsonl:line 4: malformed JSON"):
        load_prompt_file(str(tmp_path / "gap.jsonl"))


def test_malformed_line_names_file_and_line(tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a"}, {"prompt": "b"}], ['{"prompt": oops}\n'])
    with pytest.raises(ValueError, match=r"bad.jsonl:line 3: malformed JSON"):
        load_prompt_file(str(path), label_key=None)


def test_a_bad_message_list_or_metadata_string_names_file_and_line(tmp_path):
    """Both gave errors without the file or line (``'int' object has no attribute 'get'``, a bare
    JSON error): review, 2026-11-29."""
    path = _write_jsonl(tmp_path / "m.jsonl", [{"prompt": [{"role": "user", "content": "a"}]},
                                               {"prompt": [1, 2]}])
    with pytest.raises(ValueError, match=r"m.jsonl:line 2: 'prompt' is a list, so each item must be a message"):
        load_prompt_file(str(path), label_key=None)
    path = _write_jsonl(tmp_path / "w.jsonl", [{"prompt": "a"}, {"prompt": "  \n "}])
    with pytest.raises(ValueError, match=r"w.jsonl:line 2: 'prompt' must be a non-empty string"):
        load_prompt_file(str(path), label_key=None)
    path = _write_jsonl(tmp_path / "s.jsonl", [{"prompt": "a", "meta": "{}"}, {"prompt": "b", "meta": "{bad"}])
    with pytest.raises(ValueError, match=r"s.jsonl:line 2: 'meta' is a string that is not JSON"):
        load_prompt_file(str(path), label_key=None, metadata_key="meta")


def test_missing_key_and_empty(tmp_path):
    path = _write_jsonl(tmp_path / "k.jsonl", [{"prompt": "a", "label": 1}, {"prompt": "b"}])
    with pytest.raises(ValueError, match=r"k.jsonl:line 2: missing key 'label'"):
        load_prompt_file(str(path))
    with pytest.raises(ValueError, match="is empty"):
        load_prompt_file(f"{path}@[5:9]")
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        load_prompt_file(str(tmp_path / "e.jsonl"))
    with pytest.raises(ValueError, match="not found"):
        load_prompt_file(str(tmp_path / "none.jsonl"))


def test_chat_template_and_plain_fallback():
    tok = build_char_tokenizer()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1="}]
    assert render_prompt(tok, "1+1=", apply_chat_template=True) == "1+1="  # no template: plain
    assert render_prompt(tok, messages, apply_chat_template=True) == "be brief\n1+1="
    tok.chat_template = ("{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<a>{% endif %}")
    assert render_prompt(tok, messages, apply_chat_template=True) == "<s>be brief<u>1+1=<a>"
    assert render_prompt(tok, "2+2=", apply_chat_template=True) == "<u>2+2=<a>"
    assert render_prompt(tok, "2+2=", apply_chat_template=False) == "2+2="


def test_long_prompts_skipped_and_counted(tmp_path):
    tok = build_char_tokenizer()
    records = [{"prompt": "1" * n} for n in (3, 8, 5, 12)]
    kept, skipped = drop_long_prompts(records, tok, 5, False)
    assert [len(r["prompt"]) for r in kept] == [3, 5] and skipped == 2
    path = _write_jsonl(tmp_path / "l.jsonl", [{"prompt": "1" * 40}])
    cfg = load_config(None, [f"data.prompt_data={path}", "data.rollout_max_prompt_len=10",
                             "data.label_key=null"])
    with pytest.raises(ValueError, match="1 prompts were longer"):
        load_run_data(cfg, tok)


def test_load_run_data_from_file_and_task(jsonl):
    tok = build_char_tokenizer()
    cfg = load_config(None, [f"data.prompt_data={jsonl}@[0:4]", "data.input_key=question",
                             "data.label_key=answer", "data.task=countdown", "data.held_out_size=7"])
    dataset, held_out = load_run_data(cfg, tok)
    assert len(dataset) == 4 and dataset.source.endswith("@[0:4]") and len(held_out) == 7
    cfg = load_config(None, ["data.task=null"])
    with pytest.raises(ValueError, match="no prompt data"):
        load_run_data(cfg, tok)


def test_positions_cover_each_epoch_once_and_resume_exactly():
    ds = PromptDataset([{"prompt": str(i)} for i in range(7)], seed=3)
    whole = [r["prompt"] for _, r in ds.take(0, 21)]
    for epoch in range(3):
        assert sorted(whole[epoch * 7:(epoch + 1) * 7]) == sorted(str(i) for i in range(7))
    pieces = [r["prompt"] for start, n in ((0, 5), (5, 3), (8, 13))
              for _, r in PromptDataset(ds.records, seed=3).take(start, n)]
    assert pieces == whole


def test_next_data_position_reads_the_lake(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    assert next_data_position(lake, "r1", 32) == 0
    lake.append_train_step({"run_id": "r1", "step": 0, "iteration": 0,
                            "metrics": json.dumps({POSITION_METRIC: 45.0})})
    lake.append_train_step({"run_id": "r1", "step": 1, "iteration": 1,
                            "metrics": json.dumps({POSITION_METRIC: 83.0})})
    lake.append_train_step({"run_id": "r2", "step": 0, "iteration": 0, "metrics": "{}"})
    assert next_data_position(lake, "r1", 32) == 83
    assert next_data_position(lake, "r2", 32) == 32  # older rows: iterations x batch size
    with pytest.raises(ValueError, match="no rollout/data_position_end"):
        next_data_position(lake, "r2")


def test_a_misspelt_key_names_the_closest_allowed_one():
    with pytest.raises(ConfigError, match=r"'rollout.rollout_batch_sise' \(did you mean 'rollout.rollout_batch_size'\?\)"):
        load_config(None, ["rollout.rollout_batch_sise=3"])
    with pytest.raises(ConfigError, match=r"did you mean 'eval.datasets.name'"):  # in a list's item
        load_config(None, ["eval.datasets=[{nmae: x}]"])
    with pytest.raises(ConfigError, match=r"unknown config key 'zzz'$"):
        load_config(None, ["zzz=1"])  # nothing close: no suggestion


def test_bad_function_paths_fail_at_config_load():
    with pytest.raises(ConfigError, match="rollout.custom_rm_path.*cannot be loaded"):
        load_config(None, ["rollout.custom_rm_path=no_such_module:fn"])
    with pytest.raises(ConfigError, match="dynamic_sampling_filter_path.*must accept 2 positional"):
        load_config(None, ["rollout.dynamic_sampling_filter_path=rollout.data:render_prompt"])
    with pytest.raises(ConfigError, match="eval.eval_function_path"):
        load_config(None, ["eval.eval_function_path=rollout.data:nothing_here"])
    with pytest.raises(ConfigError, match="over_sampling_batch_size"):
        load_config(None, ["rollout.rollout_batch_size=8", "rollout.over_sampling_batch_size=4"])
    cfg = load_config(None, ["rollout.custom_generate_function_path=examples.calculator_tool.generate:generate",
                             "rollout.dynamic_sampling_filter_path=default"])
    assert cfg.rollout.dynamic_sampling_filter_path == "default"


def test_non_finite_numbers_run_ids_and_a_one_sample_group_baseline_are_refused():
    # trainer.lr: .inf trained to NaN weights and reported success (review, 2026-11-29)
    with pytest.raises(ConfigError, match=r"'trainer.lr': Input should be a finite number"):
        load_config(None, ["trainer.lr=.inf"])
    with pytest.raises(ConfigError, match=r"'rollout.rollout_temperature': Input should be a finite"):
        load_config(None, ["rollout.rollout_temperature=.nan"])
    # a run id names a folder under home/runs: '../x' wrote outside the home
    for bad in ("../escape", "a/b", "x'y", ".hidden", "", "a" * 129):
        with pytest.raises(ConfigError, match="'run_id'.*letters, digits"):
            load_config(None, [f"run_id={bad!r}"] if bad else ["run_id=''"])
    assert load_config(None, ["run_id=exp-1.2_b"]).run_id == "exp-1.2_b"
    # GRPO's baseline is its group's mean: one sample per prompt trains nothing
    with pytest.raises(ConfigError, match="'grpo' needs rollout.n_samples_per_prompt >= 2"):
        load_config(None, ["rollout.n_samples_per_prompt=1"])
    one = load_config(None, ["rollout.n_samples_per_prompt=1",
                             "trainer.advantage_estimator=reinforce_plus_plus"])
    assert one.rollout.n_samples_per_prompt == 1


@pytest.mark.parametrize("key", ["adam_beta1", "adam_beta2"])
def test_adam_betas_outside_zero_one_are_refused(key):
    """beta2 = 1 turned every weight NaN without an error, beta1 = 1 was a ZeroDivisionError
    mid-run (review, 2026-11-29): 0 <= beta < 1, as torch.optim.AdamW requires."""
    for bad in ("1.0", "1.5", "-0.1"):
        with pytest.raises(ConfigError, match=rf"'trainer.{key}': Input should be"):
            load_config(None, [f"trainer.{key}={bad}"])
    assert getattr(load_config(None, [f"trainer.{key}=0.0"]).trainer, key) == 0.0


def test_megatron_refuses_the_trainer_options_it_does_not_implement():
    """backend megatron trained the policy loss under loss_type sft, and failed on ppo only
    after the SFT warm-up (review, 2026-11-29): refused at config load, naming the key."""
    with pytest.raises(ConfigError, match=r"trainer.loss_type 'sft' is not supported by "
                                          r"trainer.backend 'megatron'.*policy_loss"):
        load_config(None, ["trainer.backend=megatron", "trainer.loss_type=sft"])
    with pytest.raises(ConfigError, match=r"trainer.advantage_estimator 'ppo' is not supported "
                                          r"by trainer.backend 'megatron'.*grpo, gspo, "
                                          r"reinforce_plus_plus, reinforce_plus_plus_baseline"):
        load_config(None, ["trainer.backend=megatron", "trainer.advantage_estimator=ppo"])
    # the torch backend has both; megatron keeps the others
    assert load_config(None, ["trainer.loss_type=sft"]).trainer.loss_type == "sft"
    assert load_config(None, ["trainer.advantage_estimator=ppo"]).trainer.advantage_estimator == "ppo"
    for estimator in ("grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        cfg = load_config(None, ["trainer.backend=megatron", f"trainer.advantage_estimator={estimator}",
                                 "trainer.kl_coef=0.01"])
        assert cfg.trainer.advantage_estimator == estimator


def test_an_unknown_reward_name_is_refused_with_its_key_before_anything_starts():
    """An eval set's unknown rm_type failed after the run was recorded, without its key
    (review, 2026-11-29)."""
    from infra.startup import StartupError, check_reward_names

    with pytest.raises(StartupError, match=r"eval.datasets.0.rm_type \(dataset 'x'\): unknown rm_type 'nosuch'"):
        check_reward_names(load_config(None, ["eval.datasets=[{name: x, rm_type: nosuch}]"]))
    with pytest.raises(StartupError, match=r"rollout.rm_type: unknown rm_type 'nosuch'"):
        check_reward_names(load_config(None, ["rollout.rm_type=nosuch"]))
    with pytest.raises(StartupError, match=r"rollout.rm_type: rm_type 'remote' needs rollout.rm_url"):
        check_reward_names(load_config(None, ["rollout.rm_type=remote"]))
    check_reward_names(load_config(None, ["eval.datasets=[{name: x, rm_type: boxed_math}]"]))
    # a custom reward scores every set: the names are not used
    check_reward_names(load_config(None, ["rollout.rm_type=nosuch",
                                          "rollout.custom_rm_path=tests.opshelp:length_reward"]))


def test_a_yaml_syntax_error_is_one_line_with_its_place(tmp_path):
    """PyYAML's message took seven lines with the quoted source (review, 2026-11-29)."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [lr: 1\nseed: 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(bad))
    message = str(err.value)
    assert "\n" not in message, message
    assert message == f"{bad}: not valid YAML: expected ',' or ']', but got ':' (line 2, column 5)"


def test_a_set_without_a_key_or_with_bad_yaml_says_so():
    for bad in ("=5", "trainer..lr=1", "trainer.=1"):
        with pytest.raises(ConfigError, match=r"--set expects key=value with a key"):
            load_config(None, [bad])
    with pytest.raises(ConfigError, match=r"--set trainer.lr=\[1: the value is not valid YAML: .*\(line 1"):
        load_config(None, ["trainer.lr=[1"])


def test_a_config_path_that_is_a_folder_and_a_home_that_is_a_file_are_named(tmp_path):
    from infra.env import set_environment

    with pytest.raises(ConfigError, match=f"config file {tmp_path} is a folder"):
        load_config(str(tmp_path))
    (tmp_path / "afile").write_text("")
    with pytest.raises(NotADirectoryError, match="home '.*afile' is a file, not a folder"):
        set_environment(tmp_path / "afile")


def test_a_key_given_twice_a_boolean_for_a_number_and_a_byte_order_mark(tmp_path):
    """A second ``lr:`` in one section silently won and ``seed: true`` ran as seed 1 (review,
    2026-11-29); a UTF-8 byte-order mark, which some editors write, was refused in a config and
    in a prompt file. Non-UTF-8 config text names its file."""
    twice = tmp_path / "twice.yaml"
    twice.write_text("num_rollout: 3\ntrainer:\n  lr: 0.1\n  eps_clip: 0.2\n  lr: 0.2\n")
    with pytest.raises(ConfigError, match=r"key 'lr' is given twice in one section \(line 5, column 3\)"):
        load_config(str(twice))
    # the same key in two sections is two keys
    assert load_config(None, ["trainer.lr=0.1", "sft.lr=0.2"]).trainer.lr == 0.1
    for override in ("seed=true", "trainer.lr=false", "eval.eval_interval=true"):
        with pytest.raises(ConfigError, match=r"expected a number, not a boolean"):
            load_config(None, [override])
    assert load_config(None, ["deterministic=true"]).deterministic is True
    bom = tmp_path / "bom.yaml"
    bom.write_bytes(b"\xef\xbb\xbfnum_rollout: 3\nseed: 2\n")
    assert (load_config(str(bom)).num_rollout, load_config(str(bom)).seed) == (3, 2)
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"seed: 3\n# caf\xe9\n")
    with pytest.raises(ConfigError, match=f"{latin}: not UTF-8 text"):
        load_config(str(latin))
    prompts = tmp_path / "bom.jsonl"
    prompts.write_bytes(b'\xef\xbb\xbf{"prompt": "1+1=", "label": "2"}\n{"prompt": "2+2=", "label": "4"}\n')
    assert [r["prompt"] for r in load_prompt_file(str(prompts))] == ["1+1=", "2+2="]


def test_a_lone_surrogate_anywhere_in_a_record_names_file_and_line(tmp_path):
    """JSON's ``\\ud800`` escape passed the start-up check, then crashed SFT ("TextInputSequence
    must be str") or the lake append ("surrogates not allowed") mid-run, with no file or line:
    review, 2026-11-29."""
    cases = {"prompt": '{"prompt": "1+2=\\ud800", "label": 3, "meta": {}}',
             "label": '{"prompt": "1+2=", "label": "3\\ud800", "meta": {}}',
             "meta": '{"prompt": "1+2=", "label": "3", "meta": {"k": ["ok", "\\udfff"]}}'}
    for key, line in cases.items():
        path = tmp_path / f"{key}.jsonl"
        path.write_text('{"prompt": "a", "label": "1", "meta": {}}\n' + line + "\n")
        with pytest.raises(ValueError, match=rf"{key}.jsonl:line 2: '{key}' is not valid UTF-8 text"):
            load_prompt_file(str(path), metadata_key="meta")
    messages = _write_jsonl(tmp_path / "m.jsonl", [{"prompt": [{"role": "user", "content": "\ud800"}]}])
    with pytest.raises(ValueError, match=r"m.jsonl:line 1: 'prompt' is not valid UTF-8 text"):
        load_prompt_file(str(messages), label_key=None)


def test_a_reward_module_that_fails_on_import_names_its_config_key(tmp_path, monkeypatch):
    """A RuntimeError or SyntaxError at import gave ``error: cannot init reward model`` or
    ``error: expected ':'`` without the key: review, 2026-11-29."""
    (tmp_path / "rm_raises_at_import.py").write_text('raise RuntimeError("cannot init reward model")\n')
    (tmp_path / "rm_bad_syntax.py").write_text("def reward(cfg, sample) return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"^bad config value for 'rollout.custom_rm_path': custom_rm_path "
                                          r"'rm_raises_at_import:reward' cannot be loaded: RuntimeError: "
                                          "cannot init reward model"):
        load_config(None, ["rollout.custom_rm_path=rm_raises_at_import:reward"])
    with pytest.raises(ConfigError, match=r"'rollout.custom_rm_path': .*'rm_bad_syntax:reward' cannot be "
                                          r"loaded: SyntaxError: .*rm_bad_syntax.py, line 1"):
        load_config(None, ["rollout.custom_rm_path=rm_bad_syntax:reward"])


def test_labels_keep_their_json_text_and_a_null_content_or_sample_key_is_refused(tmp_path):
    """A list label became Python's repr, NaN became "nan", ``"content": null`` became the prompt
    "None", a metadata key ``_sample`` was overwritten in the lake: review, 2026-11-29."""
    path = _write_jsonl(tmp_path / "l.jsonl", [{"prompt": "a", "label": v}
                                               for v in (3, [3, "three"], {"a": "é"}, 3.0, True, None, "x")])
    assert [r["label"] for r in load_prompt_file(str(path))] == [
        "3", '[3, "three"]', '{"a": "é"}', "3.0", "true", None, "x"]
    path.write_text('{"prompt": "a", "label": 1}\n{"prompt": "b", "label": NaN}\n')
    with pytest.raises(ValueError, match=r"l.jsonl:line 2: 'label' holds NaN or Infinity"):
        load_prompt_file(str(path))
    path = _write_jsonl(tmp_path / "c.jsonl", [{"prompt": [{"role": "user", "content": None}]}])
    with pytest.raises(ValueError, match=r"c.jsonl:line 1: 'prompt' is a list, so each item must be a message"):
        load_prompt_file(str(path), label_key=None)
    tool_call = [{"role": "user", "content": "2+2?"},
                 {"role": "assistant", "content": None, "tool_calls": [{"name": "calc"}]}]
    path = _write_jsonl(tmp_path / "t.jsonl", [{"prompt": tool_call}])
    prompt = load_prompt_file(str(path), label_key=None)[0]["prompt"]
    assert render_prompt(build_char_tokenizer(), prompt, apply_chat_template=False) == "2+2?\n"
    path = _write_jsonl(tmp_path / "s.jsonl", [{"prompt": "a", "meta": {}},
                                               {"prompt": "b", "meta": {"_sample": "hello"}}])
    with pytest.raises(ValueError, match=r"s.jsonl:line 2: 'meta' has the key '_sample', which rlake reserves"):
        load_prompt_file(str(path), label_key=None, metadata_key="meta")
