"""Timestamps as Kubernetes writes them: RFC 3339, UTC, second precision."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any


def format_time(t: datetime) -> str:
    """RFC 3339 UTC, second precision (what Kubernetes uses)."""
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: Any) -> datetime | None:
    """Parse an RFC 3339 timestamp as written by ``format_time`` (or None)."""
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).astimezone(UTC)
    except ValueError:
        return None
