"""HTTP side of an SGLang server: request payloads, response parsing, admin calls.

Pure mapping functions (payload in, GenerationResult out) plus thin ``httpx`` wrappers; no state.
"""

from __future__ import annotations

from typing import Any

import httpx

from rollout.engine import GenerationResult, SamplingParams

_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


class SGLangError(RuntimeError):
    """An SGLang server refused or failed an admin call (the message names URL and endpoint)."""


def sampling_payload(sampling: SamplingParams) -> dict[str, Any]:
    """SamplingParams -> SGLang's ``sampling_params`` dict (same names; ``seed`` ->
    ``sampling_seed``; empty stop ids omitted)."""
    out: dict[str, Any] = {
        "max_new_tokens": int(sampling.max_new_tokens),
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
        "top_k": int(sampling.top_k),
    }
    if sampling.stop_token_ids:
        out["stop_token_ids"] = [int(t) for t in sampling.stop_token_ids]
    if sampling.seed is not None:
        out["sampling_seed"] = int(sampling.seed)
    return out


def generate_payload(input_ids: list[int] | list[list[int]], sampling: SamplingParams,
                     rid: str | list[str]) -> dict[str, Any]:
    """The ``/generate`` body: token ids in, token ids + per-token logprobs out. A list of
    prompts with a list of as many ``rid`` is SGLang's batch form: one call, one result each."""
    batched = bool(input_ids) and isinstance(input_ids[0], list | tuple)
    if batched and (isinstance(rid, str) or len(rid) != len(input_ids)):
        raise ValueError(f"{len(input_ids)} prompts need as many request ids, got {rid!r}")
    return {
        "input_ids": [[int(t) for t in p] for p in input_ids] if batched else [int(t) for t in input_ids],
        "sampling_params": sampling_payload(sampling),
        "return_logprob": True,
        "rid": list(rid) if batched else rid,
    }


def parse_generate_batch(resp: list[dict[str, Any]] | dict[str, Any], n: int) -> list[GenerationResult]:
    """SGLang's answer to a batched ``/generate`` (a list, one entry per prompt, in prompt
    order) -> one GenerationResult per prompt (``parse_generate``)."""
    items = resp if isinstance(resp, list) else [resp]
    if len(items) != n:
        raise SGLangError(f"/generate: {len(items)} results for {n} prompts")
    return [parse_generate(item) for item in items]


def parse_generate(resp: dict[str, Any]) -> GenerationResult:
    """SGLang ``/generate`` response -> GenerationResult.

    ``meta_info.output_token_logprobs`` is a list of ``[logprob, token_id, text]`` (one per
    response token, EOS/stop token included); ``meta_info.finish_reason.type`` is
    stop | length | abort. The token ids are taken from the logprob entries and checked
    against ``output_ids`` when the server sends both.
    """
    meta = resp.get("meta_info") or {}
    entries = meta.get("output_token_logprobs") or []
    token_ids = [int(e[1]) for e in entries]
    logprobs = [float(e[0]) for e in entries]
    output_ids = resp.get("output_ids")
    if output_ids is not None and list(output_ids) != token_ids:
        raise SGLangError(f"/generate: output_ids {output_ids} disagree with logprob ids {token_ids}")
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else finish
    reason = _FINISH_REASONS.get(str(kind), "abort")
    keep = ("id", "weight_version", "prompt_tokens", "cached_tokens", "e2e_latency")
    return GenerationResult(
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=reason,
        meta={k: meta[k] for k in keep if k in meta},
    )


def post(client: httpx.Client, url: str, endpoint: str, body: dict | None = None,
         timeout: float | None = 600.0) -> dict[str, Any]:
    """POST an admin call; raise SGLangError unless HTTP 2xx and (if present) ``success`` is true."""
    try:
        r = client.post(f"{url}{endpoint}", json=body or {}, timeout=timeout)
    except httpx.HTTPError as e:
        raise SGLangError(f"{url}{endpoint}: {type(e).__name__}: {e}") from e
    data: dict[str, Any] = {}
    if r.content:
        try:
            data = r.json()
        except ValueError:
            data = {"message": r.text[:500]}
    if r.status_code >= 300 or data.get("success") is False:
        raise SGLangError(f"{url}{endpoint}: HTTP {r.status_code}: {data.get('message', data)}")
    return data


def get_json(client: httpx.Client, url: str, endpoint: str, timeout: float = 30.0) -> dict[str, Any]:
    """GET ``url+endpoint`` as JSON (SGLangError on failure)."""
    try:
        r = client.get(f"{url}{endpoint}", timeout=timeout)
        r.raise_for_status()
        return r.json()
    except (httpx.HTTPError, ValueError) as e:
        raise SGLangError(f"{url}{endpoint}: {type(e).__name__}: {e}") from e


def served_weight_version(client: httpx.Client, url: str) -> str:
    """The weight version a server reports in ``/model_info`` (a string, as SGLang keeps it)."""
    return str(get_json(client, url, "/model_info").get("weight_version"))


def healthy(client: httpx.Client, url: str, timeout: float, generate: bool = True) -> bool:
    """True when ``/health_generate`` (one real decode step) or ``/health`` answers 200 in time."""
    endpoint = "/health_generate" if generate else "/health"
    try:
        return client.get(f"{url}{endpoint}", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False
