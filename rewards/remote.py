"""A remote reward model: HTTP POST of the sample as JSON to ``rm_url``, with timeout + retries.

Request body: ``{"prompt", "response", "label", "metadata"}``; ``prompt`` is the text, or for a
chat prompt the list of messages (``{"role", "content", ...}`` objects) as the data gave them.
Reply: a JSON number, or an object with a number under ``"score"`` (or ``"reward"``) and any
details; anything else fails the sample (``rewards.registry``). Connection errors, timeouts and HTTP
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


def parse_reply(reply: object) -> object:
    """The reply as a reward value: a dict's ``reward`` is renamed ``score``. Its type is judged
    by the rule every reward meets (``rewards.registry``: a number, not a bool, or a dict with
    a number under ``score``); here ``{"score": true}`` and ``{"score": "0.7"}`` were accepted
    (and coerced) while a bare ``true`` was refused."""
    if isinstance(reply, dict) and "score" not in reply and "reward" in reply:
        return {**reply, "score": reply["reward"]}
    return reply


def remote_reward(url: str, prompt: str | list[dict], response: str, label: str | None, metadata: dict,
                  timeout_s: float = 10.0, retries: int = 2, backoff_s: float = 0.2) -> object:
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
