"""The embedded rollout engine: batched, KV-cached sampling with an HF model in process.

Prompts are left-padded so every row's next token sits in the last column; one forward per new
token over the whole batch, reusing the KV cache. Returns token ids, the per-token log-probs of
the sampling distribution (log softmax of logits / temperature), and the finish reason.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path

import torch

from infra.modeling import load_model
from rollout.cuda_graph import GraphedDecode, graph_slots
from rollout.engine import GenerationResult, SamplingParams
from rollout.fast_decoder import FastDecoder, supports

MAX_GRAPHS = 4  # captured decode graphs kept per engine (each holds its own KV cache)


def sample_next_token(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
                      generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw x ~ softmax(logits / T) restricted to top-k / top-p; return (x, log p(x)).

    ``temperature == 0`` means greedy (log p from softmax(logits)). The log-prob is that of the
    temperature-scaled distribution before top-k/top-p truncation, as SGLang reports it.
    """
    if temperature == 0:
        logp = torch.log_softmax(logits.float(), dim=-1)
        token = logp.argmax(dim=-1)
        return token, logp.gather(-1, token[:, None]).squeeze(-1)
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    masked = logp
    if top_k > 0 and top_k < logp.shape[-1]:
        kth = torch.topk(logp, top_k, dim=-1).values[:, -1:]
        masked = masked.masked_fill(masked < kth, float("-inf"))
    if top_p < 1.0:
        sorted_lp, order = torch.sort(masked, dim=-1, descending=True)
        cum = torch.cumsum(sorted_lp.exp(), dim=-1)
        drop_sorted = (cum - sorted_lp.exp()) > top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        masked = masked.masked_fill(drop, float("-inf"))
    # exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) is a draw from p; E = -log U with
    # U ~ U[0, 1) (measured: uniform_ + log is ~3x cheaper than exponential_, 4x than multinomial)
    race = torch.empty_like(masked).uniform_(generator=generator).log_().neg_()
    token = (masked.exp() / race).argmax(dim=-1)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


def generation_eos_ids(model_dir: str | Path) -> tuple[int, ...]:
    """``eos_token_id`` of the folder's generation_config.json (an int or a list), () without
    one. Chat models end a turn on an id that is not the tokenizer's eos (Qwen2.5-Instruct:
    <|im_end|> and <|endoftext|>; Llama-3-Instruct: <|eot_id|> and <|end_of_text|>), as
    transformers' ``generate`` and SGLang read it."""
    file = Path(model_dir) / "generation_config.json"
    if not file.is_file():
        return ()
    value = json.loads(file.read_text()).get("eos_token_id")
    ids = [] if value is None else [value] if isinstance(value, int) else value
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"{file}: eos_token_id must be an int or a list of ints, got {value!r}")
    return tuple(ids)


def eos_token_ids(model_dir: str | Path, tokenizer_eos: int | None) -> tuple[int, ...]:
    """Every id that ends a response: the tokenizer's eos, then generation_config.json's, then
    config.json's ``eos_token_id`` (an int or a list; in order, without repeats). SGLang stops
    on config.json's too (and transformers' generation defaults come from it without a
    generation_config.json): one folder gives both engines the same stop ids."""
    file = Path(model_dir) / "config.json"
    value = json.loads(file.read_text()).get("eos_token_id") if file.is_file() else None
    model_ids = [] if value is None else [value] if isinstance(value, int) else value
    if not isinstance(model_ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in model_ids):
        raise ValueError(f"{file}: eos_token_id must be an int or a list of ints, got {value!r}")
    ids = ([] if tokenizer_eos is None else [tokenizer_eos]) + list(generation_eos_ids(model_dir))
    return tuple(dict.fromkeys(ids + model_ids))


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into (input_ids [B,P], attention_mask [B,P])."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


def prompt_runs(prompts: list[list[int]]) -> list[int] | None:
    """Row i's index among the distinct prompts, consecutive equal prompts sharing one
    (0, 0, .., 1, ..); None when no two consecutive rows share a prompt."""
    groups = [0]
    for prev, prompt in pairwise(prompts):
        groups.append(groups[-1] + (prompt != prev))
    return groups if groups[-1] + 1 < len(prompts) else None


def run_starts(groups: list[int]) -> list[int]:
    """The first row of each run in ``groups``."""
    return [i for i, g in enumerate(groups) if i == 0 or g != groups[i - 1]]


class TorchEngine:
    """In-process engine over an HF causal LM on ``device`` in ``dtype`` (resolved names:
    cpu|cuda, fp32|bf16). ``update_weights`` reloads an HF checkpoint; ``load_state_dict``
    copies a trainer's tensors into the engine's own (device to device, casting if needed).
    With ``cuda_graph`` (``rollout.cuda_graph``, on by default in a run's config) the decode
    step on CUDA is replayed as a CUDA graph (rollout/cuda_graph.py). ``eos_token_id`` is one id
    or several (``eos_token_ids``: the tokenizer's, generation_config.json's, config.json's); a response
    ends at the first of any of them (included, finish reason ``stop``)."""

    name = "torch"

    def __init__(self, model_dir: str, eos_token_id: int | Sequence[int], pad_token_id: int,
                 weight_version: int = 0, seed: int = 0, max_batch_size: int = 512,
                 device: str = "cpu", dtype: str = "fp32", cuda_graph: bool = False):
        self.device, self.dtype = device, dtype
        self.cuda_graph = cuda_graph and device == "cuda"
        # graphs point at the fast decoder's tensors: valid while it lives (load_state_dict
        # copies in place), dropped with it (update_weights builds a new one)
        self._graphs: dict[tuple[int, int], GraphedDecode] = {}
        self._graph_pool = None
        self.model = load_model(model_dir, device, dtype).eval()
        self.fast = FastDecoder(self.model) if supports(self.model.config) else None
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self._weight_version = weight_version
        self.max_batch_size = max_batch_size
        self.generator = torch.Generator(device=device).manual_seed(seed)

    @property
    def eos_token_id(self) -> int:
        """The first stop id (the tokenizer's eos when built by ``eos_token_ids``); -1: none."""
        return self.eos_token_ids[0] if self.eos_token_ids else -1

    @eos_token_id.setter
    def eos_token_id(self, value: int | Sequence[int]) -> None:
        """One id or several; setting one id (-1: never stop) replaces them all."""
        self.eos_token_ids = (int(value),) if isinstance(value, int) else tuple(value)

    @property
    def weight_version(self) -> int:
        return self._weight_version

    def update_weights(self, checkpoint_dir: str, weight_version: int) -> None:
        self.model = load_model(checkpoint_dir, self.device, self.dtype).eval()
        self.fast = FastDecoder(self.model) if supports(self.model.config) else None
        self._graphs.clear()
        self._weight_version = weight_version

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, torch.Tensor], weight_version: int) -> None:
        """In-process weight hand-off (no disk round trip): each tensor is copied once into the
        engine's parameter (``copy_``: device to device, cast to the engine's dtype), and the
        fast decoder's fused matrices are re-filled in place."""
        result = self.model.load_state_dict(state_dict, strict=False)
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        missing = set(result.missing_keys) - ({"lm_head.weight"} if tied else set())
        if missing or result.unexpected_keys:
            raise ValueError(f"weights do not fit the engine's model: missing {sorted(missing)}, "
                             f"unexpected {sorted(result.unexpected_keys)}")
        if self.fast is not None:
            self.fast.refresh(self.model)
        self._weight_version = weight_version

    def shutdown(self) -> None:
        self.model = self.fast = None
        self._graphs.clear()

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[GenerationResult]:
        if sampling.seed is not None:
            self.generator.manual_seed(sampling.seed)
        results: list[GenerationResult] = []
        for start in range(0, len(prompts), self.max_batch_size):
            results.extend(self._generate_batch(prompts[start:start + self.max_batch_size], sampling))
        return results

    def _generate_batch(self, prompts: list[list[int]], sp: SamplingParams) -> list[GenerationResult]:
        dev = self.device
        batch = len(prompts)
        # a prompt's n samples share its prefill (a graphed step has a fixed batch: no sharing)
        groups = None if self.cuda_graph else prompt_runs(prompts)
        distinct = [prompts[i] for i in run_starts(groups)] if groups else prompts
        ids, mask = (t.to(dev) for t in left_pad(distinct, self.pad_token_id))
        width = ids.shape[1]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        key_valid = torch.ones((len(distinct), width + sp.max_new_tokens), dtype=torch.bool,
                               device=dev)
        key_valid[:, :width] = mask.bool()
        step = self._stepper(len(distinct), width + sp.max_new_tokens)
        logits = step.forward(ids, positions, key_valid, 0)
        if groups:
            rows_of = torch.tensor(groups, device=dev)
            step.expand(rows_of)
            logits, positions, key_valid = logits[rows_of], positions[rows_of], key_valid[rows_of]
        stop_ids = torch.tensor(sorted({*self.eos_token_ids, *sp.stop_token_ids}), dtype=torch.long,
                                device=dev)
        out_tokens = torch.full((batch, sp.max_new_tokens), self.pad_token_id, dtype=torch.long,
                                device=dev)
        out_logps = torch.zeros((batch, sp.max_new_tokens), device=dev)
        lengths = torch.zeros(batch, dtype=torch.long, device=dev)
        stopped = torch.zeros(batch, dtype=torch.bool, device=dev)
        rows = torch.arange(batch, device=dev)  # original row of each row still decoding
        done = torch.zeros(batch, dtype=torch.bool, device=dev)  # finished, not yet compacted
        step_pos, start = positions[:, -1:], width
        for t in range(sp.max_new_tokens):
            token, logp = sample_next_token(logits, sp.temperature, sp.top_p, sp.top_k, self.generator)
            token = torch.where(done, torch.full_like(token, self.pad_token_id), token)
            # rows are distinct: plain index writes, no boolean-mask gathers (host syncs on GPU);
            # a finished row's writes land past its length and are never read
            out_tokens[rows, t] = token
            out_logps[rows, t] = logp
            lengths[rows] += (~done).long()
            hit_stop = torch.isin(token, stop_ids) & ~done
            stopped[rows] = stopped[rows] | hit_stop
            done |= hit_stop
            n_done = int(done.sum())
            if n_done == len(rows) or t + 1 == sp.max_new_tokens:
                break
            step_ids, step_pos = token[:, None], step_pos + 1
            if n_done and should_compact(n_done, len(rows)) and step.compact(~done):
                keep = ~done
                rows, step_ids, step_pos = rows[keep], step_ids[keep], step_pos[keep]
                key_valid, done = key_valid[keep], done[keep]
            logits = step.forward(step_ids, step_pos, key_valid, start)
            start += 1
        lengths, stopped = lengths.tolist(), stopped.tolist()
        tokens, logps = out_tokens.tolist(), out_logps.tolist()
        return [GenerationResult(token_ids=tokens[i][:lengths[i]], logprobs=logps[i][:lengths[i]],
                                 finish_reason="stop" if stopped[i] else "length")
                for i in range(batch)]

    def _stepper(self, batch: int, max_len: int) -> _FastStep | _GraphStep | _HFStep:
        """The decode step: a CUDA graph of the fast decoder's static step on CUDA, else the
        fast decoder over a preallocated cache, else HF's forward."""
        if self.fast is None:
            return _HFStep(self.model)
        if not self.cuda_graph:
            return _FastStep(self.fast, self.fast.new_cache(batch, max_len))
        key = (batch, graph_slots(max_len))
        if key not in self._graphs:
            if len(self._graphs) >= MAX_GRAPHS:
                self._graphs.pop(next(iter(self._graphs)))
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            self._graphs[key] = GraphedDecode(self.fast, batch, key[1], pool=self._graph_pool)
        return _GraphStep(self._graphs[key])


def should_compact(n_done: int, n_rows: int) -> bool:
    """Drop finished rows once they are >= 1/8 of the rows still in the batch: each compaction
    copies the KV cache once, so it is amortised over the steps it saves."""
    return 8 * n_done >= n_rows


class _FastStep:
    """Decode steps over the fast decoder's preallocated KV cache; finished rows can be dropped."""

    def __init__(self, fast: FastDecoder, cache: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.fast, self.cache = fast, cache

    def forward(self, ids, pos, valid, start) -> torch.Tensor:
        return self.fast.forward(ids, pos, valid, self.cache, start)

    def compact(self, keep: torch.Tensor) -> bool:
        """Keep only rows ``keep`` [B] bool of the cache [L, B, kvh, T, d]."""
        self.cache = (self.cache[0][:, keep], self.cache[1][:, keep])
        return True

    def expand(self, rows: torch.Tensor) -> None:
        """Row i of the cache becomes row ``rows[i]`` of the current one (prefill sharing)."""
        self.cache = (self.cache[0][:, rows], self.cache[1][:, rows])


class _GraphStep:
    """Decode steps replayed from a captured graph; rows are never compacted (fixed shapes)."""

    def __init__(self, graphed: GraphedDecode) -> None:
        self.graphed, self.began = graphed, False

    def forward(self, ids, pos, valid, start) -> torch.Tensor:
        if not self.began:
            self.graphed.begin(valid)
            self.began = True
            return self.graphed.prefill(ids, pos)
        return self.graphed.decode(ids, pos, start)

    def compact(self, keep: torch.Tensor) -> bool:
        return False

    def expand(self, rows: torch.Tensor) -> None:
        raise NotImplementedError("a graphed decode step has a fixed batch")


class _HFStep:
    """Decode steps through HF's forward with a DynamicCache (models the fast decoder does not
    support); finished rows stay in the batch (they decode padding)."""

    def __init__(self, model: torch.nn.Module) -> None:
        from transformers import DynamicCache  # models fast_decoder.supports rejects come here

        self.model, self.cache = model, DynamicCache()

    def forward(self, ids, pos, valid, start) -> torch.Tensor:
        attn = valid[:, :start + ids.shape[1]].long()
        return self.model(input_ids=ids, attention_mask=attn, position_ids=pos,
                          past_key_values=self.cache, use_cache=True).logits[:, -1, :]

    def compact(self, keep: torch.Tensor) -> bool:
        return False

    def expand(self, rows: torch.Tensor) -> None:
        self.cache.reorder_cache(rows)
