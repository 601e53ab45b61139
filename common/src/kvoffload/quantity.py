"""Kubernetes resource quantities ("20Gi", "512Mi", "1.5G"), parsed strictly.

Shared by the operator (annotations, policies) and the sidecar (its settings);
standard library only.
"""

from __future__ import annotations

import re

_SUFFIXES: dict[str, int] = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
}
QUANTITY_PATTERN = r"^[0-9]+(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$"
"""The byte quantities kvoffload accepts: whole numbers with an optional suffix, a subset of Kubernetes'
syntax (the CRD holds the same pattern), so every one is a whole number of bytes."""
_QUANTITY = re.compile(QUANTITY_PATTERN)
MAX_BYTES = 2**50  # 1 PiB: anything above is a typo, not a cache size.


class QuantityError(ValueError):
    """A value that is not a valid byte quantity; the message names what is allowed."""


def parse_bytes(value: str, field: str) -> int:
    """Bytes in a quantity such as ``20Gi``; ``field`` names the setting in the error message."""
    match = _QUANTITY.fullmatch(value) if isinstance(value, str) else None
    if not match:
        raise QuantityError(
            f"{field}: {value!r} is not a byte quantity; use a whole number with an optional "
            "suffix Ki, Mi, Gi, Ti, Pi (powers of 2) or k, M, G, T, P (powers of 10), e.g. 20Gi"
        )
    suffix = match[1] or ""
    size = int(value[: len(value) - len(suffix)]) * _SUFFIXES[suffix]
    if size <= 0:
        raise QuantityError(f"{field}: {value!r} must be greater than zero")
    if size > MAX_BYTES:
        raise QuantityError(f"{field}: {value!r} is larger than the 1Pi this setting allows")
    return size


def bytes_to_gb(size: int) -> float:
    """Bytes as the GiB float LMCache's ``--l1-size-gb`` expects (LMCache means GiB)."""
    return size / 2**30


def format_bytes(size: int) -> str:
    """The shortest exact binary quantity for ``size`` bytes, e.g. ``20Gi``."""
    for suffix in ("Pi", "Ti", "Gi", "Mi", "Ki"):
        unit = _SUFFIXES[suffix]
        if size % unit == 0:
            return f"{size // unit}{suffix}"
    return str(size)


_KUBERNETES_SUFFIXES = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60, "m": 1}  # fmt: skip


def kubernetes_bytes(quantity: object) -> int | None:
    """Bytes of any Kubernetes memory quantity the apiserver admits (a node's or a container's), None if unreadable.

    Lenient on purpose: these are values others wrote; kvoffload's own settings use :func:`parse_bytes`.
    """
    text = str(quantity)
    for suffix in sorted(_KUBERNETES_SUFFIXES, key=len, reverse=True):
        if suffix and text.endswith(suffix):
            number = text[: -len(suffix)]
            break
    else:
        suffix, number = "", text
    try:
        value = float(number)
    except ValueError:
        return None
    return int(value / 1000) if suffix == "m" else int(value * _KUBERNETES_SUFFIXES[suffix])
