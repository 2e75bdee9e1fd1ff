"""Pure parts of the notice sources: time formats, source lists, pod conditions."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from spotguard.sidecar.notices import (
    NoticeSettings,
    disruption_notice,
    parse_http_date,
    parse_rfc3339,
    parse_sources,
)

T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC).timestamp()


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("2026-01-02T03:04:05Z", T0),
        ("2026-01-02T03:04:05.500Z", T0 + 0.5),
        ("2026-01-02T05:04:05+02:00", T0),
        ("2026-01-02T03:04:05", T0),  # no zone: UTC, as AWS means it
    ],
)
def test_parse_rfc3339(text: str, want: float) -> None:
    assert parse_rfc3339(text) == want


def test_parse_http_date() -> None:
    assert parse_http_date("Fri, 02 Jan 2026 03:04:05 GMT") == T0


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("", []),
        ("aws", ["aws"]),
        (" AWS, gce ,azure,k8s,aws", ["aws", "gce", "azure", "k8s"]),
    ],
)
def test_parse_sources(text: str, want: list[str]) -> None:
    assert parse_sources(text) == want


def test_parse_sources_rejects_unknown_with_choices() -> None:
    with pytest.raises(ValueError, match="unknown notice source.*ibm.*choose from aws"):
        parse_sources("aws,ibm")


def test_settings_default_enables_nothing() -> None:
    settings = NoticeSettings.from_env({})
    assert settings.sources == []
    assert settings.aws_endpoint == "http://169.254.169.254"


def _pod(conditions: list[dict[str, Any]], **meta: Any) -> dict[str, Any]:
    return {
        "metadata": {"uid": "u1", **meta},
        "spec": {"termination_grace_period_seconds": 45},
        "status": {"conditions": conditions},
    }


@pytest.mark.parametrize(
    ("pod", "want_deadline"),
    [
        (_pod([]), None),
        (_pod([{"type": "Ready", "status": "True"}]), None),
        (_pod([{"type": "DisruptionTarget", "status": "False"}]), None),
        (_pod([{"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}]), 1000.0 + 45),
        (
            _pod([{"type": "DisruptionTarget", "status": "True"}], deletion_timestamp=datetime.fromtimestamp(T0, UTC)),
            T0,
        ),
        (_pod([{"type": "DisruptionTarget", "status": "True"}], deletionTimestamp="2026-01-02T03:04:05Z"), T0),
        (
            {"metadata": {}, "spec": {}, "status": {"conditions": [{"type": "DisruptionTarget", "status": "True"}]}},
            1000.0 + 30,
        ),
    ],
)
def test_disruption_notice(pod: dict[str, Any], want_deadline: float | None) -> None:
    notice = disruption_notice(pod, now=1000.0)
    if want_deadline is None:
        assert notice is None
        return
    assert notice is not None
    assert notice.source == "k8s"
    assert notice.preempt
    assert notice.deadline == want_deadline
