"""Byte sizes, bandwidths and FLOP rates written the way people write them ("80GiB", "400GB/s", "989TFLOPS").

Decimal prefixes (KB, MB, GB, TB) are powers of 1000, binary ones (KiB, MiB, GiB, TiB) powers of 1024, as in
the SI/IEC standards; a lower-case "b" means bits ("400Gb/s" = 50 GB/s), as network cards are sold.
"""

from __future__ import annotations

import re

_PREFIX = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
_NUMBER = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z/]*)\s*")


class UnitError(ValueError):
    """A quantity whose unit is unknown or of the wrong kind; the message lists the valid units."""


def _split(text: str, what: str, example: str) -> tuple[float, str]:
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text), ""
    match = _NUMBER.fullmatch(str(text))
    if not match:
        raise UnitError(f"{what}={text!r} is not a number with a unit; write it like {example}")
    return float(match.group(1)), match.group(2)


def _scale(unit: str, base: str, what: str, text: str, example: str) -> float:
    """The multiplier of `unit` = prefix + base, e.g. 'GiB' with base 'B'."""
    for prefix, factor in _PREFIX.items():
        if unit == prefix + base or (prefix and unit == prefix.upper() + base):
            return factor
    valid = ", ".join(p + base for p in ("", "K", "M", "G", "T", "Ki", "Mi", "Gi", "Ti"))
    raise UnitError(f"{what}={text!r}: unknown unit {unit!r}; use one of {valid} (for example {example})")


def parse_bytes(text: str | int | float, what: str = "size") -> int:
    """'80GiB' -> 85899345920. A bare number is bytes."""
    value, unit = _split(text, what, "80GiB")
    if unit in ("", "B"):
        return int(value)
    if unit.endswith("b") and not unit.endswith("B"):
        raise UnitError(f"{what}={text!r} is in bits; memory is counted in bytes, write e.g. "
                        f"{value:g}{unit[:-1]}B")
    return int(value * _scale(unit, "B", what, text, "80GiB"))


def parse_bandwidth(text: str | int | float, what: str = "bandwidth") -> float:
    """Bytes per second from '400GB/s', '50GiB/s' or '400Gb/s' (bits); a bare number is bytes/s."""
    value, unit = _split(text, what, "400GB/s")
    if unit == "":
        return value
    if unit.lower().endswith("bps"):
        unit = unit[:-3] + "b/s"
    if not unit.endswith("/s"):
        raise UnitError(f"{what}={text!r}: a bandwidth needs a per-second unit such as GB/s or Gb/s "
                        f"(for example 400GB/s)")
    unit = unit[:-2]
    if unit.endswith("b") and not unit.endswith("B"):
        return value * _scale(unit[:-1] + "B", "B", what, text, "400Gb/s") / 8
    return value * _scale(unit, "B", what, text, "400GB/s")


def parse_flops(text: str | int | float, what: str = "FLOP rate") -> float:
    """FLOP/s from '989TFLOPS', '312e12' or '67 TFLOP/s'."""
    value, unit = _split(text, what, "989TFLOPS")
    if unit == "":
        return value
    normal = unit.upper().replace("FLOP/S", "FLOPS")
    if not normal.endswith("FLOPS"):
        raise UnitError(f"{what}={text!r}: unknown unit {unit!r}; use FLOPS with an optional prefix "
                        "(K, M, G, T, P), for example 989TFLOPS")
    prefix = normal[:-5]
    if prefix not in ("", "K", "M", "G", "T", "P"):
        raise UnitError(f"{what}={text!r}: unknown prefix {prefix!r}; use K, M, G, T or P (e.g. 989TFLOPS)")
    return value * _PREFIX[prefix]


def format_bytes(n: float) -> str:
    """Binary units, 3 significant figures: 1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"
