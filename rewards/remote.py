"""A remote reward model: HTTP POST of the sample as JSON to ``rm_url``, with timeout + retries.

Request body: ``{"prompt", "response", "label", "metadata"}``. Reply: a JSON number, or an
object with ``"score"`` (or ``"reward"``) and any details. Connection errors, timeouts and HTTP
5xx are retried ``retries`` times with exponential backoff (``backoff_s * 2**attempt``); a 4xx or
a reply without a score fails at once.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request


class RemoteRewardError(RuntimeError):
    pass


def post_json(url: str, payload: dict, timeout_s: float) -> object:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310 - configured URL
        return json.loads(resp.read().decode() or "null")


def parse_reply(reply: object) -> float | dict:
    """A number, or a dict holding ``score`` (``reward`` is renamed to ``score``)."""
    if isinstance(reply, bool) or reply is None:
        raise RemoteRewardError(f"remote reward reply is not a score: {reply!r}")
    if isinstance(reply, int | float):
        return float(reply)
    if isinstance(reply, dict):
        if "score" in reply:
            return reply
        if "reward" in reply:
            return {**reply, "score": reply["reward"]}
    raise RemoteRewardError(f"remote reward reply has no 'score': {reply!r}")


def remote_reward(url: str, prompt: str, response: str, label: str | None, metadata: dict,
                  timeout_s: float = 10.0, retries: int = 2, backoff_s: float = 0.2) -> float | dict:
    payload = {"prompt": prompt, "response": response, "label": label, "metadata": metadata}
    last: Exception | None = None
    for attempt in range(retries + 1):
        try:
            return parse_reply(post_json(url, payload, timeout_s))
        except urllib.error.HTTPError as err:
            if err.code < 500:
                raise RemoteRewardError(f"{url} answered HTTP {err.code}") from None
            last = err
        except (urllib.error.URLError, TimeoutError, ConnectionError, json.JSONDecodeError) as err:
            last = err
        if attempt < retries:
            time.sleep(backoff_s * 2 ** attempt)
    raise RemoteRewardError(f"{url} failed after {retries + 1} attempts: {last}")
