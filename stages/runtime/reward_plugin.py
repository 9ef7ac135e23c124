"""A reward function of the user's own (score.reward_fn), found and called the same way everywhere:
`syncrl check` imports it before any allocation time is spent, the score stage calls it per row.

Torch-free, as the score stage is: the function is the user's code, and its failures name the
function and the row it failed on.
"""

from __future__ import annotations

import importlib
import math
from typing import Callable

from stages.runtime.config import ConfigError

# What GSM8K scoring fills in on every scored row; a reward function may give its own.
GSM8K_FIELDS = ("correct", "formatted")


def load(spec: str) -> Callable:
    """The function `spec` ("package.module:function") names, imported."""
    module_name, _, name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 (the user's module: whatever it raises on import)
        raise ConfigError(f"score.reward_fn {spec!r}: module {module_name!r} could not be imported "
                          f"({type(e).__name__}: {e}); install it or put its folder on PYTHONPATH on every node") \
            from None
    fn = getattr(module, name, None)
    if fn is None:
        raise ConfigError(f"score.reward_fn {spec!r}: module {module_name!r} ({module.__file__}) has no {name!r}")
    if not callable(fn):
        raise ConfigError(f"score.reward_fn {spec!r}: {module_name}.{name} is a {type(fn).__name__}, not a function")
    return fn


class RewardError(RuntimeError):
    """The reward function raised, or returned something that is not a reward."""


def call(fn: Callable, spec: str, completion: str, problem: dict, cfg, where: str) -> dict:
    """fn's reward for one completion as the scored row's fields: "reward", "correct" and "formatted"
    where it gives them, and its other named numbers under "reward_terms". `where` names the row for
    an error."""
    try:
        out = fn(completion, problem, cfg)
    except Exception as e:
        raise RewardError(f"score.reward_fn {spec} raised on {where}: {type(e).__name__}: {e}") from e
    fields = {"reward": out} if not isinstance(out, dict) else dict(out)
    bad = {k: v for k, v in fields.items() if not _number(v)}
    if "reward" not in fields or bad:
        raise RewardError(f"score.reward_fn {spec} returned {out!r} on {where}: return a number, or a dict with "
                          f"'reward' and other named numbers or booleans"
                          + (f" (not numbers: {', '.join(sorted(bad))})" if bad else ""))
    reward = float(fields.pop("reward"))
    if not math.isfinite(reward):
        raise RewardError(f"score.reward_fn {spec} returned reward {reward} on {where}: it must be finite")
    own = {k: bool(fields.pop(k)) for k in GSM8K_FIELDS if k in fields}
    return {"reward": reward, **own, **({"reward_terms": fields} if fields else {})}


def _number(v) -> bool:
    return isinstance(v, (bool, int, float))
