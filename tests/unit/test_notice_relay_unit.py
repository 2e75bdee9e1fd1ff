"""The notice relay's pure parts: who is asking (a TokenReview's status), what they may see, what pods carry.

The relay itself, against a real apiserver and real pod-bound tokens, is in
tests/integration/test_operator.py; the chart's RBAC for it in test_chart.py.
"""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime
from typing import Any

import pytest

from spotguard import notice_relay
from spotguard.operator.notices import (
    EXTRA_POD_NAME,
    EXTRA_POD_UID,
    MAX_BODY,
    MAX_MESSAGE,
    Caller,
    Refused,
    bearer_token,
    caller_of,
    check_pod,
    check_served,
    event_request,
    pod_view,
    relayed_event,
    token_review,
)
from spotguard.operator.podbuilder import OperatorConfig, build_pod
from spotguard.operator.spec import parse
from spotguard.operator.specfields import SpecError
from spotguard.sidecar.notices import (
    KubernetesDisruptionNotices,
    NoticeSettings,
    build_sources,
    disruption_notice,
    relay_error,
)

CALLER = Caller("team-a", "demo-a1", "uid-pod")


def review(**user: Any) -> dict[str, Any]:
    """A TokenReview status as the 1.20 apiserver returns it for a pod-bound token of our audience."""
    base: dict[str, Any] = {
        "username": "system:serviceaccount:team-a:default",
        "uid": "uid-sa",
        "groups": ["system:serviceaccounts", "system:serviceaccounts:team-a", "system:authenticated"],
        "extra": {EXTRA_POD_NAME: ["demo-a1"], EXTRA_POD_UID: ["uid-pod"]},
    }
    return {"authenticated": True, "user": {**base, **user}, "audiences": [notice_relay.AUDIENCE]}


def refusal(call: Any, *args: Any) -> tuple[int, str]:
    with pytest.raises(Refused) as err:
        call(*args)
    return err.value.status, err.value.message


# --- who is asking ------------------------------------------------------------------------


def test_bearer_token() -> None:
    assert bearer_token("Bearer abc.def") == "abc.def"
    assert bearer_token("bearer  abc ") == "abc"
    for header in (None, "", "Bearer", "Bearer  ", "Basic dXNlcjpwYXNz", "abc.def"):
        status, message = refusal(bearer_token, header)
        assert status == 401 and notice_relay.AUDIENCE in message, header


def test_token_review_asks_for_the_relays_audience_only() -> None:
    body = token_review("t0k3n")
    assert body == {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenReview",
        "spec": {"token": "t0k3n", "audiences": [notice_relay.AUDIENCE]},
    }


def test_caller_is_the_pod_the_token_is_bound_to() -> None:
    assert caller_of(review()) == CALLER
    # The namespace is the account's (a pod-bound token's pod is in its account's namespace).
    other = review(username="system:serviceaccount:team-b:trainer")
    assert caller_of(other) == Caller("team-b", "demo-a1", "uid-pod")


@pytest.mark.parametrize(
    ("status", "code"),
    [
        ({"authenticated": False, "user": {}, "error": "invalid bearer token"}, 401),
        ({"user": {}, "error": "token audiences [...] is invalid"}, 401),
        # Authenticated, but not for our audience (an apiserver with no audiences of its own accepts any).
        ({**review(), "audiences": []}, 401),
        ({**review(), "audiences": ["https://kubernetes.default.svc"]}, 401),
        ({k: v for k, v in review().items() if k != "audiences"}, 401),
        # A user, not a ServiceAccount.
        (review(username="admin"), 403),
        (review(username="system:serviceaccount:team-a"), 403),
        # A ServiceAccount token bound to no pod (a Secret's, or a TokenRequest without boundObjectRef).
        (review(extra={}), 403),
        ({**review(), "user": {k: v for k, v in review()["user"].items() if k != "extra"}}, 403),
        (review(extra={EXTRA_POD_NAME: ["demo-a1"]}), 403),
        (review(extra={EXTRA_POD_NAME: ["a", "b"], EXTRA_POD_UID: ["uid-pod"]}), 403),
        (review(extra={EXTRA_POD_NAME: "demo-a1", EXTRA_POD_UID: "uid-pod"}), 403),
        # A bound Secret-based token (kind Secret) carries no pod extras either.
        (review(extra={"authentication.kubernetes.io/secret-name": ["s"]}), 403),
    ],
)
def test_caller_refusals(status: dict[str, Any], code: int) -> None:
    got, message = refusal(caller_of, status)
    assert got == code, message


def test_namespaces_not_served_are_refused() -> None:
    check_served(CALLER, ())
    check_served(CALLER, frozenset({"team-a", "team-b"}))
    assert refusal(check_served, CALLER, frozenset({"team-b"})) == (
        403,
        "namespace team-a is not served by this operator",
    )


# --- what they may see ----------------------------------------------------------------------


def pod(
    labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None, uid: str = "uid-pod", **status: Any
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "demo-a1",
            "namespace": "team-a",
            "uid": uid,
            "labels": labels or {},
            "annotations": annotations or {},
            "resourceVersion": "7",
            "managedFields": [{"manager": "kubelet"}],
        },
        "spec": {
            "nodeName": "node-1",
            "terminationGracePeriodSeconds": 45,
            "serviceAccountName": "default",
            "containers": [{"name": "trainer", "env": [{"name": "SECRET", "value": "x"}]}],
        },
        "status": {
            "phase": "Running",
            "podIP": "10.0.0.9",
            "conditions": [{"type": "Ready", "status": "True"}],
            **status,
        },
    }


def test_check_pod() -> None:
    mine = pod({"spotguard.dev/job": "demo"})
    assert check_pod(CALLER, mine) is mine
    injected = pod({"spotguard.dev/inject": "true"}, {"spotguard.dev/injected": "s3://b/ns/job"})
    assert check_pod(CALLER, injected) is injected
    assert refusal(check_pod, CALLER, None)[0] == 404
    # A token of an earlier pod with the same name never reads the new one.
    assert refusal(check_pod, CALLER, pod({"spotguard.dev/job": "demo"}, uid="uid-new"))[0] == 403
    for other in (
        pod(),
        pod({"app": "web"}),
        pod({"spotguard.dev/job": ""}),
        pod({"spotguard.dev/inject": "true"}),
        pod({"spotguard.dev/inject": "false"}, {"spotguard.dev/injected": "s3://b"}),
    ):
        status, message = refusal(check_pod, CALLER, other)
        assert status == 403 and "not spotguard's" in message


def test_pod_view_is_minimal_and_enough_for_the_notice() -> None:
    deleting = "2026-01-02T03:04:05Z"
    full = pod(
        {"spotguard.dev/job": "demo"},
        conditions=[
            {"type": "Ready", "status": "True"},
            {"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet", "message": "shutdown"},
        ],
    )
    full["metadata"]["deletionTimestamp"] = deleting
    view = pod_view(full)
    assert view == {
        "metadata": {"uid": "uid-pod", "deletionTimestamp": deleting},
        "spec": {"terminationGracePeriodSeconds": 45, "nodeName": "node-1"},
        "status": {"conditions": full["status"]["conditions"]},
    }
    assert "SECRET" not in json.dumps(view) and "podIP" not in json.dumps(view)
    # What the sidecar does with it, after a round trip through JSON.
    notice = disruption_notice(json.loads(json.dumps(view)), now=1000.0)
    assert notice is not None and notice.key == "k8s:uid-pod:TerminationByKubelet"
    assert notice.deadline == datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC).timestamp()
    calm = pod_view(pod({"spotguard.dev/job": "demo"}))
    assert calm["metadata"]["deletionTimestamp"] is None and disruption_notice(calm, now=1000.0) is None
    grace = pod_view(pod({"spotguard.dev/job": "demo"}, conditions=[{"type": "DisruptionTarget", "status": "True"}]))
    assert disruption_notice(grace, now=1000.0).deadline == 1045.0  # type: ignore[union-attr]


# --- Events for the sidecar -----------------------------------------------------------------


def test_event_request() -> None:
    reason = notice_relay.REASON_METRICS_PORT_UNAVAILABLE
    assert event_request(json.dumps({"reason": reason, "message": "port taken"}).encode()) == (reason, "port taken")
    assert event_request(json.dumps({"reason": reason}).encode()) == (reason, "")
    long = event_request(json.dumps({"reason": reason, "message": "x" * 3000}).encode())
    assert len(long[1]) == MAX_MESSAGE and long[1].endswith("...")
    for body, code in (
        (b"", 400),
        (b"not json", 400),
        (b"[1]", 400),
        (b"\xff", 400),
        (json.dumps({"reason": "Killing", "message": "m"}).encode(), 400),
        (json.dumps({"message": "m"}).encode(), 400),
        (json.dumps({"reason": reason, "message": 3}).encode(), 400),
        (b"{" + b" " * MAX_BODY + b"}", 413),
    ):
        assert refusal(event_request, body)[0] == code, body


def test_relayed_event_is_on_the_callers_own_pod() -> None:
    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    event = relayed_event(CALLER, "node-1", "MetricsPortUnavailable", "port taken", when, "op-1")
    assert event["metadata"] == {"generateName": "demo-a1.", "namespace": "team-a"}
    assert event["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": "demo-a1",
        "namespace": "team-a",
        "uid": "uid-pod",
    }
    assert (event["type"], event["reason"], event["message"]) == ("Warning", "MetricsPortUnavailable", "port taken")
    assert event["source"] == {"component": "spotguard-sidecar", "host": "node-1"}
    assert event["reportingInstance"] == "op-1" and event["firstTimestamp"] == "2026-01-02T03:04:05Z"


def test_the_sidecars_reasons_are_relayed() -> None:
    from spotguard.sidecar.events import REASON_METRICS_PORT_UNAVAILABLE

    assert REASON_METRICS_PORT_UNAVAILABLE in notice_relay.RELAYED_REASONS
    assert notice_relay.event_url("http://op.ns.svc:8081/notices/v1/pod") == "http://op.ns.svc:8081/notices/v1/event"


# --- the pods -------------------------------------------------------------------------------

URL = "http://rel-spotguard.spotguard-system.svc:8081/notices/v1/pod"


def raw_spec(notices: list[str], **pod_spec: Any) -> dict[str, Any]:
    return {
        "template": {"spec": {**pod_spec, "containers": [{"name": "trainer", "image": "trainer:1"}]}},
        "checkpoint": {"storage": "s3://bucket/root"},
        "preemption": {"notices": notices},
    }


def build(notices: list[str], url: str | None = URL, native: bool = False, **pod_spec: Any) -> dict[str, Any]:
    cfg = OperatorConfig(native_sidecar=native, notice_url=url)
    return build_pod("demo", "team-a", "uid-1", parse(raw_spec(notices, **pod_spec)), 1, cfg)


def containers(built: dict[str, Any]) -> dict[str, dict[str, Any]]:
    spec = built["spec"]
    return {c["name"]: c for c in spec.get("initContainers", []) + spec["containers"]}


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in container["env"]}


@pytest.mark.parametrize("native", [False, True])
def test_k8s_pods_keep_their_account_and_only_the_sidecar_gets_the_token(native: bool) -> None:
    built = build(["k8s", "aws"], native=native, serviceAccountName="trainer-sa")
    assert built["spec"]["serviceAccountName"] == "trainer-sa"  # the template's own, accepted now
    (volume,) = [v for v in built["spec"]["volumes"] if v["name"] == "spotguard-notice-token"]
    assert volume["projected"] == {
        "sources": [
            {"serviceAccountToken": {"audience": "spotguard.dev/notices", "expirationSeconds": 600, "path": "token"}}
        ]
    }
    by_name = containers(built)
    sidecar = by_name["spotguard-sidecar"]
    assert {
        "name": "spotguard-notice-token",
        "mountPath": "/var/run/secrets/spotguard.dev/notices",
        "readOnly": True,
    } in sidecar["volumeMounts"]
    env = env_of(sidecar)
    assert env["SPOTGUARD_NOTICE_URL"] == URL and env["SPOTGUARD_NOTICES"] == "k8s,aws"
    assert env["SPOTGUARD_NOTICE_TOKEN_FILE"] == "/var/run/secrets/spotguard.dev/notices/token"
    for name, c in by_name.items():
        if name != "spotguard-sidecar":
            assert all(m["name"] != "spotguard-notice-token" for m in c.get("volumeMounts", [])), name
            assert "SPOTGUARD_NOTICE_URL" not in env_of(c), name


def test_no_token_without_the_k8s_source_or_without_a_relay() -> None:
    for built in (build(["aws"]), build([]), build(["k8s"], url=None)):
        assert "serviceAccountName" not in built["spec"]
        assert all(v["name"] != "spotguard-notice-token" for v in built["spec"]["volumes"])
        assert "SPOTGUARD_NOTICE_URL" not in env_of(containers(built)["spotguard-sidecar"])


def test_the_token_volume_name_is_reserved() -> None:
    with pytest.raises(SpecError, match="reserved") as err:
        parse(raw_spec(["k8s"], volumes=[{"name": "spotguard-notice-token", "emptyDir": {}}]))
    assert err.value.field == "spec.template.spec.volumes[0].name"


# --- the operator's and the sidecar's settings --------------------------------------------


def parser() -> argparse.ArgumentParser:
    from spotguard.operator import cli

    top = argparse.ArgumentParser()
    cli.register(top.add_subparsers())
    return top


def test_operator_notice_url_setting() -> None:
    from spotguard.operator.cli import notice_url_problem
    from spotguard.operator.handlers import OperatorOptions, operator_config

    assert parser().parse_args(["operator"]).notice_url is None
    assert parser().parse_args(["operator", "--notice-url", URL]).notice_url == URL
    # An older command line still parses (the flag is ignored, with a warning at start).
    assert parser().parse_args(["operator", "--notice-cluster-role", "x"]).notice_cluster_role == "x"
    live = "http://0.0.0.0:8081/healthz"
    assert notice_url_problem(None, live) is None and notice_url_problem(URL, live) is None
    assert "http://" in str(notice_url_problem("https://op.ns.svc:8081/notices/v1/pod", live))
    assert "/notices/v1/pod" in str(notice_url_problem("http://op.ns.svc:8081/", live))
    assert "--liveness" in str(notice_url_problem(URL, None))
    options = OperatorOptions(native_sidecar="off", notice_url=URL)
    assert operator_config(options, core=None).notice_url == URL


def test_sidecar_settings_use_the_relay_when_given(tmp_path: Any) -> None:
    settings = NoticeSettings.from_env(
        {
            "SPOTGUARD_NOTICES": "k8s",
            "SPOTGUARD_NOTICE_URL": URL,
            "SPOTGUARD_NOTICE_TOKEN_FILE": str(tmp_path / "token"),
        }
    )
    assert (settings.relay_url, settings.relay_token_file) == (URL, str(tmp_path / "token"))
    (source,) = build_sources(settings)  # no POD_NAME needed: the relay knows the pod from the token
    assert isinstance(source, KubernetesDisruptionNotices) and source.relay_url == URL
    # A missing token file is an answer of "no notice", with the reason; the token is never in it.
    assert source.poll() is None and "token" in str(source.last_error)
    default = NoticeSettings.from_env({})
    assert default.relay_url is None and default.relay_token_file == notice_relay.TOKEN_FILE
    with pytest.raises(ValueError, match="SPOTGUARD_NOTICE_URL"):
        build_sources(NoticeSettings(sources=["k8s"]))


def test_relay_error_text() -> None:
    assert relay_error(b'{"error": "namespace x is not served"}') == "namespace x is not served"
    assert relay_error(b"<html>bad gateway</html>") == "<html>bad gateway</html>"
    assert relay_error(b"") == "(no body)"


def test_the_relays_caches_expire_and_claims_hold_for_their_time() -> None:
    from spotguard.operator.notices import _Expiring

    now = [100.0]
    cache = _Expiring(lambda: now[0])
    cache.put("pod", {"uid": "u"}, 1.0)
    assert cache.get("pod") == (True, {"uid": "u"})
    assert cache.claim("event", 60.0) and not cache.claim("event", 60.0)
    now[0] += 1.0
    assert cache.get("pod") == (False, None)  # read again from the apiserver
    assert not cache.claim("event", 60.0)
    now[0] += 59.0
    assert cache.claim("event", 60.0)
