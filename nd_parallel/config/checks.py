"""The errors a bad setting raises, and the value checks every option group shares.

A message names the setting, the value given (and its type when that is what is wrong) and a fix the user can
write back into the config.
"""

from __future__ import annotations

import difflib
import numbers
import re
from typing import Any


class ConfigError(ValueError):
    """An invalid parallelism setting; the message names the value and the fix."""


class ConfigTypeError(ConfigError, TypeError):
    """A setting of the wrong type (catchable as ValueError or as TypeError)."""


def _kind(value: Any) -> str:
    """'an int', 'a str': the type of a bad value, for messages."""
    name = type(value).__name__
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _suggest(value: Any, choices: list[str] | tuple[str, ...], noun: str = "values") -> str:
    """'did you mean ...?' when a choice is close, else the list of valid choices."""
    value = str(value)
    # Retry lower-cased so that "Interleaved1F1B" still finds "interleaved-1f1b".
    close = (difflib.get_close_matches(value, choices, n=1)
             or difflib.get_close_matches(value.lower(), choices, n=1))
    if close:
        return f"did you mean {close[0]!r}?"
    return f"valid {noun} are: " + ", ".join(repr(c) for c in sorted(choices))


def _int_guess(value: Any) -> int | None:
    """The integer a mistyped count most likely meant, if there is one."""
    if isinstance(value, bool):
        return 1
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
        return int(value)
    return None


def _check_count(name: str, value: Any, neutral: str, *, size: bool = False) -> int:
    """A positive integer, returned as a plain int; dp_shard_size may also be -1.

    `neutral` is the setting that turns the feature off (e.g. "tp_size=1 to disable tensor parallelism"), quoted as
    the fix; `size` marks the five layout sizes, whose type error says "sizes".
    """
    if not _is_int(value):
        what = "sizes must be integers" if size else f"{name} must be an integer"
        guess = _int_guess(value)
        fix = f"write {name}={guess}" if guess is not None else f"for example use {neutral}"
        raise ConfigTypeError(f"{name}={value!r} is {_kind(value)}; {what}, {fix}")
    value = int(value)
    if value == -1 and name == "dp_shard_size":
        return value
    if value == -1:
        raise ConfigError(
            f"{name}=-1 is not allowed: only dp_shard_size may be -1 (the ranks left over); "
            f"give {name} a positive value, for example {neutral}")
    if value < 1:
        also = " or -1" if name == "dp_shard_size" else ""
        raise ConfigError(f"{name}={value} must be a positive integer{also}; use {neutral}")
    return value


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    valid = ", ".join(repr(c) for c in choices)
    if not isinstance(value, str):
        raise ConfigTypeError(f"{name}={value!r} is {_kind(value)}; expected one of {valid}")
    if value not in choices:
        raise ConfigError(f"unknown {name}={value!r}; {_suggest(value, choices)} (valid: {valid})")


def _check_bool(name: str, value: Any) -> None:
    # No coercion: bool("false") is True, so a quoted "false" would silently switch the option on.
    if not isinstance(value, bool):
        raise ConfigTypeError(f"{name}={value!r} is {_kind(value)}; write True or False")
