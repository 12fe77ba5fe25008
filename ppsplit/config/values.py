"""Read one value of the composed config, typed and checked: a bad value is a
:class:`PpsplitError` whose one line names the key and what is allowed."""

from __future__ import annotations

import math

from ppsplit.errors import PpsplitError, nearest

def plain(value):
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def get(cfg, key: str, default=None):
    from omegaconf import OmegaConf

    try:
        value = OmegaConf.select(cfg, key, default=default, throw_on_missing=True)
    except Exception as err:  # a missing mandatory value (???) or a broken interpolation
        raise PpsplitError(f"{key}: {str(err).splitlines()[0]}") from None
    return plain(value)


def integer(key: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PpsplitError(f"{key}={value!r}: must be an integer{_range(minimum, maximum)}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise PpsplitError(f"{key}={value!r}: allowed: an integer{_range(minimum, maximum)}")
    return value


def _range(minimum, maximum) -> str:
    if minimum is not None and maximum is not None:
        return f" {minimum} to {maximum}"
    if minimum is not None:
        return f" >= {minimum}"
    return f" <= {maximum}" if maximum is not None else ""


def opt_integer(key: str, value, minimum: int | None = None) -> int | None:
    return None if value is None else integer(key, value, minimum)


def number(key: str, value, minimum: float = 0.0, exclusive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PpsplitError(f"{key}={value!r}: allowed: a finite number {'>' if exclusive else '>='} {minimum:g}")
    if value < minimum or (exclusive and value == minimum):
        raise PpsplitError(f"{key}={value!r}: allowed: a number {'>' if exclusive else '>='} {minimum:g}")
    return float(value)


def boolean(key: str, value) -> bool:
    if not isinstance(value, bool):
        raise PpsplitError(f"{key}={value!r}: allowed: true or false")
    return value


def choice(key: str, value, allowed) -> str:
    if value not in allowed:
        raise PpsplitError(f"{key}={value!r} is not known; allowed: {', '.join(allowed)}"
                           f"{nearest(str(value), allowed)}")
    return value


def text(key: str, value, optional: bool = True) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise PpsplitError(f"{key}={value!r}: must be a non-empty string")
    return value


def mapping(key: str, value) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise PpsplitError(f"{key}={value!r}: must be a mapping, e.g. {{name: value}}")
    return value


# What a model is trained on, from its task: the inputs ppsplit makes and the loss it takes
# (model.inputs and model.loss; "auto" reads the task from the class name).
TASKS = ("causal_lm", "masked_lm", "seq2seq", "image_classification")
