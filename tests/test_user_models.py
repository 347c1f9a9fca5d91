"""A user's own HF model folder and data (review M): tiny models and real BPE tokenizers built
offline with transformers/tokenizers, in the layouts users' folders come in.

- ``eval.datasets: []`` (the only way to run without an eval set on one's own data) runs, with
  no eval anywhere (it crashed: ``rt.eval_sets[0]``);
- the SFT warm-up renders prompts as RL does (chat messages, ``apply_chat_template``) and refuses
  rows without a label (trained as the text "None");
- the context check reads GPT-2's ``n_positions`` (the run died mid-run, "index out of range");
- a checkpoint keeps a ``vocab.json`` + ``merges.txt`` tokenizer, and its config.json's dtype is
  that of the weights written (fp32 under a bf16 base's "bfloat16").
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from infra.config import load_config
from tests.conftest import run_cli
from tests.opshelp import TINY

CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def bpe_tokenizer(chat: bool = True):
    """A byte-level BPE (Qwen2's kind) trained on a few lines, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(["12+34=46", "what is 3+4? answer 7", "hello world"] * 10,
                             trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                 initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    if chat:
        tok.chat_template = CHAT
    return tok


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- bug 1: eval.datasets: [] -------------------------------------------------------------

def test_evaluate_without_an_eval_set_evaluates_nothing():
    """No eval set: nothing generated or written, accuracy None (``rt.eval_sets[0]`` raised)."""
    from tasks.eval import evaluate

    rt = SimpleNamespace(eval_sets=[], engine=SimpleNamespace(weight_version=3))
    assert evaluate.call(rt, 2) == {"accuracy": None, "weight_version": 3}


def test_progress_display_shows_no_eval_line_without_an_eval_set():
    """An iteration's ``eval/accuracy`` None (async/replay: ``evaluate`` with no eval set) and
    an eval event of None print no eval line and leave the iteration line's accuracy out."""
    from rich.console import Console

    from infra.progress import RichReporter

    console = Console(record=True, width=200)
    reporter = RichReporter(console)
    reporter("rl_start", {"start": 0, "total": 2})
    reporter("eval", {"iteration": 0, "accuracy": None})
    reporter("iteration", {"iteration": 0, "eval/accuracy": None, "time/total": 0.1})
    assert "eval after" not in console.export_text() and reporter.last_acc is None


def test_a_run_with_no_eval_set_trains_and_reports(tmp_path):
    """``eval.datasets=[]`` on one's own data: the run finishes (it crashed "list index out of
    range"), evaluates nothing (no evals rows, no eval line, no before/after accuracy, even
    with eval_interval 1), and ``rlake status`` / ``rlake report`` read it."""
    data = write_jsonl(tmp_path / "add.jsonl",
                       [{"prompt": f"{a}+{a + 1}=", "label": str(2 * a + 1)} for a in range(10, 18)])
    home = tmp_path / "home"
    env = {"PREFECT_HOME": str(home / "prefect")}
    proc = run_cli(["run", "configs/quickstart.yaml", "--run-id", "noeval", "--set", f"home={home}",
                    *TINY, "--set", "sft.enabled=false", "--set", "data.task=null",
                    "--set", f"data.prompt_data={data}", "--set", "eval.datasets=[]",
                    "--set", "eval.eval_interval=1", "--set", "num_rollout=2",
                    "--set", "trainer.global_batch_size=16", "--set", "trainer.micro_batch_size=16"],
                   env=env, timeout=300)
    assert "rlake run finished" in proc.stdout
    assert "eval after" not in proc.stdout and "before RL" not in proc.stdout
    from buffer import Lake

    lake = Lake(str(home / "lake"))
    assert lake.read("evals", run_id="noeval").num_rows == 0
    assert lake.read("train_steps", run_id="noeval").num_rows == 2
    status = run_cli(["status", "noeval", "--home", str(home)], env=env, timeout=120)
    assert "completed" in status.stdout
    run_cli(["report", "noeval", "--home", str(home), "--out", str(tmp_path / "r.html")],
            env=env, timeout=120)
    assert (tmp_path / "r.html").is_file()


# --- bug 5: the SFT warm-up's prompts and labels ------------------------------------------

def sft_runtime(tmp_path: Path, rows: list[dict], chat: bool) -> SimpleNamespace:
    """The parts of a runtime ``sft_batch`` / ``training_accuracy`` read."""
    from rollout.data import PromptDataset, load_prompt_file

    path = write_jsonl(tmp_path / "p.jsonl", rows)
    cfg = load_config(None, [f"data.prompt_data={path}", "data.task=null", "sft.batch_size=2",
                             "sft.check_size=2", f"data.apply_chat_template={str(chat).lower()}"])
    dataset = PromptDataset(load_prompt_file(str(path)), seed=0, source=str(path))
    return SimpleNamespace(cfg=cfg, dataset=dataset, tokenizer=bpe_tokenizer())


@pytest.mark.parametrize("prompt", [[{"role": "user", "content": "12+34="}], "12+34="],
                         ids=["chat_messages", "plain_text"])
def test_sft_trains_on_the_prompts_rl_generates_from(tmp_path, prompt):
    """Chat prompts failed ("text input must be of type str"); plain ones with
    apply_chat_template true were trained un-templated while RL generates templated."""
    from rollout.rollout import make_samples
    from tasks.sft import sft_batch

    rt = sft_runtime(tmp_path, [{"prompt": prompt, "label": "46"}] * 2, chat=True)
    batch = sft_batch(rt, 0)
    rl = make_samples(list(enumerate(rt.dataset.records)), rt.tokenizer, 1, "p",
                      apply_chat_template=True)
    assert batch.prompt_token_ids == [s.prompt_token_ids for s in rl]
    assert rt.tokenizer.decode(batch.prompt_token_ids[0]).startswith("<|im_start|>user\n")


def test_sft_accuracy_check_renders_the_template(tmp_path, monkeypatch):
    """The warm-up's greedy accuracy check generates from the templated prompt too."""
    import tasks.sft as sft

    rt = sft_runtime(tmp_path, [{"prompt": [{"role": "user", "content": "1+2="}], "label": "3"}] * 2,
                     chat=True)
    rt.engine = SimpleNamespace(weight_version=0, load_state_dict=lambda w, v: None)
    rt.sampling, rt.reward_fn = (lambda greedy: None), None
    seen = []
    monkeypatch.setattr(sft, "in_process_weights", lambda rt: {})
    monkeypatch.setattr(sft, "generate_samples", lambda engine, tok, samples, sp: seen.extend(samples))

    def score(samples, fn):
        for s in samples:
            s.reward = 1.0

    monkeypatch.setattr(sft, "score_samples", score)
    assert sft.training_accuracy(rt) == 1.0
    assert rt.tokenizer.decode(seen[0].prompt_token_ids).startswith("<|im_start|>user\n")


def test_sft_refuses_rows_without_a_label(tmp_path):
    """A null label (fine for a custom reward) was trained as the text "None": with the
    warm-up on, a new run's row is named (file:line) before anything is recorded; with it off,
    or on a resume (its warm-up may be done), the data loads."""
    from infra.startup import check_data

    path = write_jsonl(tmp_path / "u.jsonl", [{"prompt": "1+1=", "label": "2"},
                                              {"prompt": "2+2=", "label": None}])
    custom = "rollout.custom_rm_path=tests.opshelp:length_reward"
    cfg = load_config(None, [f"data.prompt_data={path}", "data.task=null", custom])
    with pytest.raises(ValueError, match=rf"{path}:line 2: a null 'label', and the SFT warm-up"):
        check_data(cfg)
    check_data(cfg, new_run=False)
    cfg = load_config(None, [f"data.prompt_data={path}", "data.task=null", "data.label_key=null", custom])
    with pytest.raises(ValueError, match=rf"{path}:line 1: no label \(data.label_key is null\)"):
        check_data(cfg)
    check_data(load_config(None, [f"data.prompt_data={path}", "data.task=null", "sft.enabled=false", custom]))


# --- bug 6: GPT-2's n_positions -----------------------------------------------------------

def test_context_check_reads_gpt2_n_positions(tmp_path):
    """GPT-2 names its context ``n_positions``: an over-long prompt is refused at load (naming
    its line) instead of the run dying mid-run with "index out of range in self"."""
    from transformers import GPT2Config

    from infra.modeling import build_char_tokenizer
    from rollout.setup import context_limit, load_run_data

    model = tmp_path / "gpt2"
    GPT2Config(n_positions=64, n_embd=32, n_layer=1, n_head=2).save_pretrained(model)
    data = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "1+1=", "label": "2"},
                                                 {"prompt": "1" * 80, "label": "1"}])
    cfg = load_config(None, [f"model.path={model}", f"data.prompt_data={data}", "data.task=null",
                             "rollout.rollout_max_response_len=8"])
    assert context_limit(cfg, None) == 64 - 8
    with pytest.raises(ValueError, match=rf"{data}:line 2: prompt has 80 tokens, more than "
                                         r"data.max_prompt_tokens=56"):
        load_run_data(cfg, build_char_tokenizer())


# --- bugs 7, 8: what a checkpoint of a user's folder holds --------------------------------

@pytest.fixture(scope="module")
def bf16_slow_tokenizer_qwen(tmp_path_factory) -> Path:
    """A tiny Qwen2 saved in bf16 (config.json "dtype": "bfloat16") whose tokenizer is
    ``vocab.json`` + ``merges.txt`` (no tokenizer.json), as many hub folders ship it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("qwen_slowtok")
    tok = bpe_tokenizer()
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=128, tie_word_embeddings=True,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    fast = json.loads((out / "tokenizer.json").read_text())["model"]
    (out / "vocab.json").write_text(json.dumps(fast["vocab"]))
    (out / "merges.txt").write_text("#version: 0.2\n" + "".join(
        (m if isinstance(m, str) else " ".join(m)) + "\n" for m in fast["merges"]))
    (out / "tokenizer.json").unlink()
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    tok_config["tokenizer_class"] = "Qwen2Tokenizer"
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config))
    # a named chat template, in the folder transformers saves them to (tool_use, rag, ...)
    (out / "additional_chat_templates").mkdir()
    (out / "additional_chat_templates" / "tool_use.jinja").write_text(TOOL_TEMPLATE)
    return out


TOOL_TEMPLATE = "{% for m in messages %}<tool>{{ m['content'] }}</tool>{% endfor %}"


@pytest.fixture(scope="module")
def trainer_checkpoint(bf16_slow_tokenizer_qwen, tmp_path_factory) -> Path:
    """The torch trainer's checkpoint of that folder (rlake's own Qwen2 on CPU, fp32)."""
    from infra.config import TrainerConfig
    from trainers.torch_trainer import TorchTrainer

    trainer = TorchTrainer(str(bf16_slow_tokenizer_qwen),
                           TrainerConfig(lr=1e-3, global_batch_size=2, micro_batch_size=2), 2)
    out = tmp_path_factory.mktemp("ckpt") / "v000001"
    trainer.save(str(out))
    trainer.checkpoint_writer.wait()
    return out


def test_checkpoint_keeps_a_vocab_merges_tokenizer(bf16_slow_tokenizer_qwen, trainer_checkpoint):
    """The checkpoint loads with AutoTokenizer and encodes as the base (it had no tokenizer)."""
    from transformers import AutoTokenizer

    assert (trainer_checkpoint / "vocab.json").is_file() and (trainer_checkpoint / "merges.txt").is_file()
    base = AutoTokenizer.from_pretrained(bf16_slow_tokenizer_qwen)
    saved = AutoTokenizer.from_pretrained(trainer_checkpoint)
    text = "what is 12+34? <|im_end|> hello"
    assert saved(text)["input_ids"] == base(text)["input_ids"]
    assert saved.eos_token == base.eos_token


def test_checkpoints_keep_the_named_chat_templates(bf16_slow_tokenizer_qwen, trainer_checkpoint,
                                                  tmp_path):
    """A tokenizer's named chat templates (``additional_chat_templates/*.jinja``) were left out
    of the checkpoints, of the torch trainer's and of the Megatron trainer's HF export: a run
    rendering prompts with one found none in its own checkpoints."""
    from transformers import AutoTokenizer

    from trainers.megatron.trainer import write_hf_checkpoint

    exported = tmp_path / "megatron-export"
    write_hf_checkpoint({"w": torch.zeros(1)}, str(bf16_slow_tokenizer_qwen), exported)
    for folder in (trainer_checkpoint, exported):
        assert (folder / "additional_chat_templates" / "tool_use.jinja").read_text() == TOOL_TEMPLATE
    saved = AutoTokenizer.from_pretrained(trainer_checkpoint)
    templates = saved.chat_template if isinstance(saved.chat_template, dict) else {}
    assert templates.get("tool_use") == TOOL_TEMPLATE, saved.chat_template


def test_checkpoint_config_dtype_is_the_weights_dtype(trainer_checkpoint):
    """fp32 weights under the bf16 base's "dtype": "bfloat16" were loaded by transformers as
    bf16; the config now says float32, and transformers loads them as such."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    with safe_open(str(trainer_checkpoint / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    assert json.loads((trainer_checkpoint / "config.json").read_text())["dtype"] == "float32"
    assert AutoModelForCausalLM.from_pretrained(trainer_checkpoint).dtype == torch.float32


def test_no_evaluation_is_ever_due_without_an_eval_set():
    """``eval_due`` said yes at the start, every eval_interval and at the end even with no eval
    set: async mode handed its weights to the evaluation engine for nothing there, and sync
    mode held an iteration's commit in line for an evaluation that did nothing."""
    from types import SimpleNamespace

    from flows.steps import eval_due
    from infra.config import RunConfig

    cfg = RunConfig(eval={"eval_interval": 2})
    with_sets = SimpleNamespace(cfg=cfg, eval_sets=["held_out"])
    assert [eval_due(with_sets, done, 5) for done in range(6)] == [True, False, True, False, True, True]
    without = SimpleNamespace(cfg=cfg, eval_sets=[])
    assert not any(eval_due(without, done, 5) for done in range(6))
