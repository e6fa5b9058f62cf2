"""Pure: Kubernetes resource quantities and Go durations, as KubeRay reads them."""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation

_SUFFIXES = {
    "": Decimal(1),
    "m": Decimal("0.001"),
    "k": Decimal(10) ** 3,
    "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15,
    "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10,
    "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50,
    "Ei": Decimal(2) ** 60,
}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")


class QuantityError(ValueError):
    pass


def parse_quantity(value: object) -> Decimal:
    """'500m' -> 0.5, '5Gi' -> 5368709120, 2 -> 2."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise QuantityError(f"{value!r} is not a Kubernetes quantity")
    text = str(value).strip()
    match = _QUANTITY.match(text)
    if not match:
        raise QuantityError(f"{value!r} is not a Kubernetes quantity like '500m', '2' or '5Gi'")
    try:
        number = Decimal(match.group(1))
    except InvalidOperation as exc:
        raise QuantityError(f"{value!r} is not a Kubernetes quantity") from exc
    if number < 0:
        raise QuantityError(f"{value!r} is negative")
    return number * _SUFFIXES[match.group(2) or ""]


def quantity_value(value: object) -> int:
    """Kubernetes' `Quantity.Value()`, which KubeRay uses for num-cpus, memory and num-gpus:
    rounded up to an integer ('500m' -> 1)."""
    return math.ceil(parse_quantity(value))


_DURATION_PART = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {
    "ns": Decimal("1e-9"),
    "us": Decimal("1e-6"),
    "µs": Decimal("1e-6"),
    "ms": Decimal("0.001"),
    "s": Decimal(1),
    "m": Decimal(60),
    "h": Decimal(3600),
}


def parse_duration_seconds(value: object) -> float:
    """What KubeRay accepts in `ray.io/initializing-timeout`: a Go duration ('30m', '1h30m',
    '90s') or a whole number of seconds ('600')."""
    text = str(value).strip()
    if re.fullmatch(r"[0-9]+", text):
        return float(int(text))
    position, total = 0, Decimal(0)
    for match in _DURATION_PART.finditer(text):
        if match.start() != position:
            break
        total += Decimal(match.group(1)) * _UNIT_SECONDS[match.group(2)]
        position = match.end()
    if position != len(text) or not text:
        raise QuantityError(f"{value!r} is not a duration like '30m', '1h30m', '90s' or '600'")
    return float(total)


def format_duration(seconds: float) -> str:
    """A Go duration that parse_duration_seconds reads back exactly."""
    return f"{seconds:g}s" if seconds != int(seconds) else f"{int(seconds)}s"


def format_memory(num_bytes: int) -> str:
    for suffix in ("Ti", "Gi", "Mi", "Ki"):
        unit = int(_SUFFIXES[suffix])
        if num_bytes >= unit and num_bytes % unit == 0:
            return f"{num_bytes // unit}{suffix}"
    return str(num_bytes)
