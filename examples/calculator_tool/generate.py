"""Custom generate function: the model writes ``[12*7]``, the calculator answers ``84``, the
answer is appended to the context (loss_mask 0) and generation goes on.

    rollout:
      custom_generate_function_path: examples.calculator_tool.generate:generate

Signature (rlake's ``custom_generate_function_path``): ``generate(ctx, sample, sampling) ->
Sample`` with ``ctx.engine``, ``ctx.tokenizer``, ``ctx.cfg``; ``sampling.max_new_tokens`` is the
budget for the whole response (model and tool tokens together, as in slime's multi-turn
examples); ``sampling.seed`` is dropped (re-seeding on every call would make a group's samples
identical). At most ``metadata["max_turns"]`` (default 4) tool calls.
"""

from __future__ import annotations

from dataclasses import replace

from rewards.tasks import evaluate_expression
from rollout.engine import SamplingParams
from rollout.multiturn import assemble_turns, model_turn, tool_turn
from rollout.rollout import decode_response
from rollout.sample import Sample, Status

OPEN, CLOSE = "[", "]"
MAX_TURNS = 4


def calculator(expression: str) -> str:
    """The value of ``expression`` (ints, + - * /, parentheses): an integer, or a decimal with at
    most 4 places; ``err`` for anything it cannot evaluate."""
    try:
        value, _ = evaluate_expression(expression)
    except ValueError:
        return "err"
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.4f}".rstrip("0").rstrip(".")


def tool_call(text: str) -> str | None:
    """The expression of a call ending ``text`` (``...[expr]``), or None."""
    if not text.endswith(CLOSE) or OPEN not in text:
        return None
    return text[text.rindex(OPEN) + 1:-1]


def generate(ctx, sample: Sample, sampling: SamplingParams) -> Sample:
    """Model turns stopped at ``]``; each ``[expr]`` is a tool call, answered by the calculator.
    Only calls count against ``max_turns``: a lone ``]`` is text, and the model goes on (when
    it counted as a turn, ``]]]]]`` ended a response at 5 tokens of a 24-token budget, recorded
    truncated; review, 2026-11-29). The response ends at EOS, at the budget, or at a call
    beyond ``max_turns`` (not run: truncated)."""
    tok = ctx.tokenizer
    close_id = tok.convert_tokens_to_ids(CLOSE)
    budget = sampling.max_new_tokens
    max_calls = int(sample.metadata.get("max_turns", MAX_TURNS))
    turns, ids, versions = [], [], []
    finish, status = "length", Status.TRUNCATED
    calls = 0
    while len(ids) < budget:
        res = ctx.engine.generate([sample.prompt_token_ids + ids],
                                  replace(sampling, max_new_tokens=budget - len(ids), seed=None,
                                          stop_token_ids=(*sampling.stop_token_ids, close_id)))[0]
        versions.append(ctx.engine.weight_version)
        turns.append(model_turn(res.token_ids, res.logprobs))
        ids += res.token_ids
        if not (res.finish_reason == "stop" and res.token_ids and res.token_ids[-1] == close_id):
            finish = res.finish_reason  # EOS, or out of budget
            status = Status.COMPLETED if finish == "stop" else Status.TRUNCATED
            break
        expr = tool_call(tok.decode(res.token_ids, skip_special_tokens=True))
        if expr is None:  # a lone "]": no call, the model goes on
            continue
        if calls == max_calls:  # out of turns: the call is left unanswered
            break
        calls += 1
        output = tok(calculator(expr), add_special_tokens=False)["input_ids"][:budget - len(ids)]
        turns.append(tool_turn(output))
        ids += output
    token_ids, logprobs, mask = assemble_turns(turns)
    return replace(sample, response_token_ids=token_ids, rollout_log_probs=logprobs, loss_mask=mask,
                   response=decode_response(tok, token_ids), finish_reason=finish, status=status,
                   weight_version=ctx.engine.weight_version, weight_versions=versions,
                   metadata={**sample.metadata, "tool_calls": calls})
