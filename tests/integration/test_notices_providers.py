"""Notice sources against local servers that answer as each provider documents.

No cloud is contacted: every endpoint is a fake on 127.0.0.1 (see
``notice_fakes.py`` for the fakes). These tests need no S3 or apiserver.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from notice_fakes import FakeAws, FakeAzure, FakeGce, serve

from spotguard.sidecar.notices import (
    AwsSpotNotices,
    AzureScheduledEvents,
    GcePreemptionNotices,
    Notice,
    NoticeSource,
    NoticeWatcher,
)


def test_aws_token_flow_and_instance_action() -> None:
    with serve(FakeAws()) as aws:
        source = AwsSpotNotices(aws.url)
        assert source.poll() is None
        assert source.last_error is None
        # One token for both GETs of the poll, reused by the next poll.
        assert aws.count("PUT", "/latest/api/token") == 1
        assert aws.count("GET", "/latest/meta-data/spot/instance-action") == 1
        assert aws.count("GET", "/latest/meta-data/events/recommendations/rebalance") == 1
        aws.instance_action = {"action": "terminate", "time": "2026-01-02T03:04:05Z"}
        notice = source.poll()
        assert notice is not None
        assert (notice.source, notice.preempt) == ("aws", True)
        assert notice.deadline == datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC).timestamp()
        assert aws.count("PUT", "/latest/api/token") == 1


def test_aws_fetches_a_new_token_when_refused() -> None:
    with serve(FakeAws()) as aws:
        source = AwsSpotNotices(aws.url)
        assert source.poll() is None
        aws.revoke_tokens()
        aws.instance_action = {"action": "stop", "time": "2026-01-02T03:04:05Z"}
        notice = source.poll()
        assert notice is not None and "stop" in notice.detail
        assert aws.count("PUT", "/latest/api/token") == 2


def test_aws_rebalance_is_advisory() -> None:
    with serve(FakeAws()) as aws:
        aws.rebalance = {"noticeTime": "2026-01-02T03:04:05Z"}
        notice = AwsSpotNotices(aws.url).poll()
        assert notice is not None
        assert (notice.source, notice.preempt, notice.deadline) == ("aws_rebalance", False, None)
        # An interruption outranks the recommendation.
        aws.instance_action = {"action": "terminate", "time": "2026-01-02T03:04:05Z"}
        notice = AwsSpotNotices(aws.url).poll()
        assert notice is not None and notice.source == "aws"


def test_gce_preempted_flag() -> None:
    with serve(FakeGce()) as gce:
        now = [1000.0]
        source = GcePreemptionNotices(gce.url, clock=lambda: now[0])
        assert source.poll() is None
        assert source.last_error is None
        gce.preempted = True
        notice = source.poll()
        assert notice is not None and notice.preempt
        assert notice.deadline == 1030.0
        now[0] = 1010.0
        # The deadline stays anchored at the first sighting.
        again = source.poll()
        assert again is not None and again.deadline == 1030.0


def test_azure_preempt_event_and_acknowledgement() -> None:
    with serve(FakeAzure()) as azure:
        source = AzureScheduledEvents(azure.url)
        assert source.poll() is None
        azure.add_event(
            {
                "EventId": "reboot-1",
                "EventType": "Reboot",
                "ResourceType": "VirtualMachine",
                "Resources": ["vm1"],
                "EventStatus": "Scheduled",
                "NotBefore": "Fri, 02 Jan 2026 03:04:05 GMT",
            }
        )
        assert source.poll() is None  # not a preemption
        azure.add_event(
            {
                "EventId": "pre-1",
                "EventType": "Preempt",
                "ResourceType": "VirtualMachine",
                "Resources": ["vm1"],
                "EventStatus": "Scheduled",
                "NotBefore": "Fri, 02 Jan 2026 03:04:05 GMT",
                "EventSource": "Platform",
                "DurationInSeconds": -1,
            }
        )
        notice = source.poll()
        assert notice is not None
        assert (notice.source, notice.event_id, notice.preempt) == ("azure", "pre-1", True)
        assert notice.deadline == datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC).timestamp()
        source.acknowledge(notice)
        assert azure.approved == ["pre-1"]
        assert source.last_error is None


def test_wrong_or_missing_headers_are_refused_by_the_fakes() -> None:
    # The fakes enforce the documented headers, so the tests above prove we send them.
    from spotguard.sidecar.notices import http_request

    with serve(FakeGce()) as gce, serve(FakeAzure()) as azure, serve(FakeAws()) as aws:
        assert http_request(f"{gce.url}/computeMetadata/v1/instance/preempted").status == 403
        assert http_request(f"{azure.url}/metadata/scheduledevents?api-version=2020-07-01").status == 400
        assert http_request(f"{aws.url}/latest/api/token", method="PUT").status == 400
        assert http_request(f"{aws.url}/latest/meta-data/spot/instance-action").status == 401


@pytest.mark.parametrize("make", [AwsSpotNotices, GcePreemptionNotices, AzureScheduledEvents])
def test_unreachable_endpoint_is_no_notice_not_a_crash(make: type) -> None:
    with serve(FakeGce()) as dead:
        url = dead.url
    # The server is gone: connection refused.
    source = make(url, timeout=0.5)
    assert source.poll() is None
    assert source.last_error


def test_watcher_dispatches_each_notice_once() -> None:
    with serve(FakeAzure()) as azure:
        seen: list[Notice] = []

        def on_notice(notice: Notice, source: NoticeSource) -> None:
            seen.append(notice)

        watcher = NoticeWatcher([AzureScheduledEvents(azure.url)], on_notice)
        assert watcher.poll_once() == []
        azure.add_event({"EventId": "pre-9", "EventType": "Preempt", "NotBefore": ""})
        assert len(watcher.poll_once()) == 1
        assert watcher.poll_once() == []
        azure.add_event({"EventId": "pre-10", "EventType": "Preempt", "NotBefore": ""})
        watcher.poll_once()
        assert [n.event_id for n in seen] == ["pre-9", "pre-10"]
