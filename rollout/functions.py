"""User function paths (``package.module:function``): resolved and signature-checked up front.

A bad path or a function that cannot take the arguments rlake passes is an error when the config
is loaded, never at iteration 37. ``SIGNATURES`` lists, per config key, the positional
arguments rlake calls the function with (docs/rollout.md has an example of each).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

# config key -> names of the positional arguments the function is called with
SIGNATURES: dict[str, tuple[str, ...]] = {
    "rollout_function_path": ("ctx", "iteration"),
    "custom_generate_function_path": ("ctx", "sample", "sampling"),
    "custom_rm_path": ("cfg", "sample"),
    "dynamic_sampling_filter_path": ("cfg", "group"),
    "eval_function_path": ("ctx", "dataset"),
}


def load_function(path: str, n_params: int | None = None, what: str = "function") -> Callable:
    """Resolve ``package.module:function`` (``package.module.function`` also accepted, as slime
    writes it) and check it can be called with ``n_params`` positional arguments."""
    if ":" in path:
        module_name, attr = path.split(":", 1)
    elif "." in path:
        module_name, attr = path.rsplit(".", 1)
    else:
        raise ValueError(f"{what} '{path}' must look like 'package.module:function'")
    if os.getcwd() not in sys.path:
        # the folder rlake runs in, as `python -m` would have it, but last: a file there named
        # like one of rlake's packages (rewards.py) must not replace it. Without it a function
        # beside the config, or the documented `rlake run examples/calculator_tool/config.yaml`,
        # was "No module named ..." (review, 2026-11-29); reward workers get this sys.path
        sys.path.append(os.getcwd())
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except Exception as err:  # noqa: BLE001 - any failure at import (SyntaxError, a raise) is a config error
        raise ValueError(f"{what} '{path}' cannot be loaded: {type(err).__name__}: {err}") from None
    if not callable(fn):
        raise ValueError(f"{what} '{path}' is not callable")
    if n_params is not None:
        try:
            inspect.signature(fn).bind(*range(n_params))
        except TypeError:
            raise ValueError(f"{what} '{path}' must accept {n_params} positional arguments, "
                             f"its signature is {inspect.signature(fn)}") from None
        except ValueError:  # builtins without a signature: trust them
            pass
    return fn


def load_configured(key: str, path: str | None) -> Callable | None:
    """The function configured under ``key`` (one of ``SIGNATURES``), or None when unset."""
    if not path:
        return None
    return load_function(path, len(SIGNATURES[key]), key)


def call(fn: Callable, *args: Any) -> Any:
    """Call a user function; an ``async def`` one (as slime users write them) is run to completion."""
    out = fn(*args)
    if inspect.isawaitable(out):
        return asyncio.run(_await(out))
    return out


class UserFunctionError(RuntimeError):
    """An exception raised inside a user's function, re-raised naming the function."""


def call_named(label: str, fn: Callable, *args: Any) -> Any:
    """``call``, with an exception the function raises re-raised naming it (``label``: its config
    key and path), the original chained: a bare "error: 'nope'" (a KeyError in a generate
    function) did not say which user function failed (review, 2026-11-29). One already named (a
    generate function's, raised through the rollout function that called ``ctx.generate``)
    passes as it is, naming the innermost function. Only ``Exception``: Ctrl-C
    (KeyboardInterrupt) and SystemExit pass through as they are."""
    try:
        return call(fn, *args)
    except UserFunctionError:
        raise
    except Exception as err:
        raise UserFunctionError(f"{label} raised {type(err).__name__}: {err}") from err


async def _await(awaitable):
    return await awaitable
