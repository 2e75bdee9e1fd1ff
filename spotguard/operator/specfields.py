"""Reading a spec's raw fields: the error that names a field, and one typed reader per kind of value.

A spec arrives as untyped YAML (a TrainingJob, or a pod annotation the webhook
reads). Every parser of :mod:`~spotguard.operator.spec` and
:mod:`~spotguard.operator.staging` reads it through these readers, so each
refusal is a :class:`SpecError` whose ``field`` is the path the user wrote
(``spec.checkpoint.retention.keepLast``). This module knows no field of its
own; the fields and their rules live with the parsers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

#: A DNS subdomain (RFC 1123): the names of Secrets and StorageClasses.
DNS_SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


class SpecError(ValueError):
    """A spec (or pod annotation) the operator refuses; ``field`` names where."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


def read_obj(raw: Any, path: str, *, required: bool = False) -> Mapping[str, Any]:
    """``raw`` as an object (``{}`` when absent and not required)."""
    if raw is None:
        if required:
            raise SpecError(path, "is required")
        return {}
    if not isinstance(raw, Mapping):
        raise SpecError(path, f"must be an object, not {type(raw).__name__}")
    return raw


def read_str(raw: Mapping[str, Any], key: str, path: str, *, required: bool = False) -> str | None:
    """``raw[key]`` as a string (None when absent or empty and not required)."""
    value = raw.get(key)
    if value is None or value == "":
        if required:
            raise SpecError(f"{path}.{key}", "is required")
        return None
    if not isinstance(value, str):
        raise SpecError(f"{path}.{key}", f"must be a string, not {type(value).__name__}")
    return value


def read_int(raw: Mapping[str, Any], key: str, path: str, default: int | None, *, minimum: int = 0) -> int | None:
    """``raw[key]`` as an integer of at least ``minimum`` (``default`` when absent; booleans refused)."""
    value = raw.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{path}.{key}", f"must be an integer, not {value!r}")
    if value < minimum:
        raise SpecError(f"{path}.{key}", f"must be >= {minimum}, not {value}")
    return value


def read_num(
    raw: Mapping[str, Any], key: str, path: str, default: float | None, *, minimum: float = 0.0
) -> float | None:
    """``raw[key]`` as a number of at least ``minimum`` (``default`` when absent; booleans refused)."""
    value = raw.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SpecError(f"{path}.{key}", f"must be a number, not {value!r}")
    if value < minimum:
        raise SpecError(f"{path}.{key}", f"must be >= {minimum:g}, not {value}")
    return float(value)


def read_bool(raw: Mapping[str, Any], key: str, path: str, default: bool) -> bool:
    """``raw[key]`` as true or false (``default`` when absent)."""
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise SpecError(f"{path}.{key}", f"must be true or false, not {value!r}")
    return value


def read_enum(raw: Mapping[str, Any], key: str, path: str, choices: tuple[str, ...], default: str) -> str:
    """``raw[key]`` as one of ``choices`` (``default`` when absent)."""
    value = read_str(raw, key, path) or default
    if value not in choices:
        raise SpecError(f"{path}.{key}", f"must be one of {', '.join(choices)}, not {value!r}")
    return value


def read_str_map(raw: Any, path: str) -> dict[str, str]:
    """``raw`` as an object of string values (labels, annotations, a nodeSelector)."""
    obj = read_obj(raw, path)
    out: dict[str, str] = {}
    for k, v in obj.items():
        if not isinstance(v, str):
            raise SpecError(f"{path}.{k}", "must be a string")
        out[str(k)] = v
    return out
