"""The real nodes' cluster DNS without a network: packets, the records of pods and headless Services, answers."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest

from testenv.realnode import dns
from testenv.realnode.config import NodeAddresses, kubelet_config

NAME = "job-0.job-workers.team.svc.cluster.local"


def pod(name: str, ip: str | None, ns: str = "team", ready: bool = False, **spec: Any) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": "Running" if ip else "Pending"}
    if ip:
        status["podIP"] = ip
    status["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
    return {
        "metadata": {"name": name, "namespace": ns, "labels": {"job": "job"}},
        "spec": {"hostname": name, "subdomain": "job-workers", **spec},
        "status": status,
    }


def service(
    name: str = "job-workers", ns: str = "team", headless: bool = True, not_ready: bool = True
) -> dict[str, Any]:
    spec: dict[str, Any] = {"clusterIP": "None" if headless else "10.0.0.7", "selector": {"job": "job"}}
    if not_ready:
        spec["publishNotReadyAddresses"] = True
    return {"metadata": {"name": name, "namespace": ns}, "spec": spec}


def test_query_round_trip_and_case() -> None:
    q = dns.parse_query(dns.encode_query("Job-0.Job-Workers.team.svc.cluster.local.", dns.TYPE_A, 0xBEEF))
    assert (q.id, q.name, q.qtype, q.qclass) == (0xBEEF, NAME, dns.TYPE_A, dns.CLASS_IN)
    assert q.flags & 0x0100  # recursion desired, as stub resolvers ask


def test_query_as_a_resolver_sends_it_with_an_edns_record() -> None:
    # glibc and busybox add an OPT record (EDNS0) after the question: it must not disturb the question.
    packet = bytes.fromhex("12340120000100000000000104736f6d6507636c7573746572056c6f63616c0000010001")
    packet += bytes.fromhex("0000291000000000000000")
    q = dns.parse_query(packet)
    assert (q.id, q.name, q.qtype) == (0x1234, "some.cluster.local", dns.TYPE_A)
    assert q.question == packet[12:-11]


@pytest.mark.parametrize(
    ("packet", "why"),
    [
        (b"\x00\x01", "shorter than a DNS header"),
        (struct.pack("!HHHHHH", 1, 0x8180, 1, 0, 0, 0) + dns.encode_name("a.b") + b"\0\1\0\1", "a response"),
        (struct.pack("!HHHHHH", 1, 0x0100, 0, 0, 0, 0), "no question"),
        (struct.pack("!HHHHHH", 1, 0x0100, 1, 0, 0, 0) + b"\x05ab", "label runs past"),
        (struct.pack("!HHHHHH", 1, 0x0100, 1, 0, 0, 0) + b"\xc0\x0c\0\1\0\1", "compressed"),
        (struct.pack("!HHHHHH", 1, 0x0100, 1, 0, 0, 0) + dns.encode_name("a.b") + b"\0", "without type"),
    ],
)
def test_unreadable_packets_are_refused_with_a_reason(packet: bytes, why: str) -> None:
    with pytest.raises(dns.FormatError, match=why):
        dns.parse_query(packet)


def test_name_encoding() -> None:
    assert dns.encode_name("a.bc.") == b"\x01a\x02bc\x00"
    assert dns.encode_name(".") == b"\x00"
    with pytest.raises(ValueError, match="bad DNS label"):
        dns.encode_name("a..b")
    with pytest.raises(ValueError, match="bad DNS label"):
        dns.encode_name("x" * 64 + ".local")


def test_response_wire_form() -> None:
    q = dns.parse_query(dns.encode_query("a.cluster.local", query_id=7))
    reply = dns.encode_response(q, dns.NOERROR, ["127.80.1.2", "127.80.2.3"], ttl=5)
    header = struct.unpack("!HHHHHH", reply[:12])
    # Response, authoritative, recursion desired echoed, NOERROR; one question, two answers.
    assert header == (7, 0x8500, 1, 2, 0, 0)
    assert reply[12 : 12 + len(q.question)] == q.question
    first = reply[12 + len(q.question) :][:16]
    assert first == struct.pack("!HHHIH", 0xC00C, 1, 1, 5, 4) + bytes([127, 80, 1, 2])
    assert dns.parse_response(reply) == (dns.NOERROR, ["127.80.1.2", "127.80.2.3"])
    refused = dns.encode_response(q, dns.REFUSED)
    assert struct.unpack("!H", refused[2:4])[0] == 0x8105  # not authoritative for what it refuses


def test_records_of_pods_with_hostname_and_subdomain() -> None:
    pods = [
        pod("job-0", "127.80.1.2"),
        pod("job-1", "127.80.2.2"),
        pod("job-2", None),  # no IP yet
        pod("job-3", "127.80.1.9", subdomain="other"),  # another subdomain: no name of its own
        pod("elsewhere", "127.80.1.5", ns="other-team"),  # the Service is in another namespace
    ]
    pods[1]["metadata"]["labels"] = {"job": "job"}
    recs = dns.records(pods, [service(), service("plain", headless=False)])
    assert recs[NAME] == ("127.80.1.2",)
    assert recs["job-1.job-workers.team.svc.cluster.local"] == ("127.80.2.2",)
    assert recs["job-workers.team.svc.cluster.local"] == ("127.80.1.2", "127.80.1.9", "127.80.2.2")
    assert "job-2.job-workers.team.svc.cluster.local" not in recs
    assert "job-3.job-workers.team.svc.cluster.local" not in recs
    assert "job-3.other.team.svc.cluster.local" not in recs
    assert not any("elsewhere" in n or "plain" in n for n in recs)
    # The names above a record exist (empty), so a resolver walking down is not told NXDOMAIN.
    assert recs["team.svc.cluster.local"] == () and recs["cluster.local"] == ()


def test_records_follow_readiness_selector_and_pod_lifecycle() -> None:
    gone = pod("job-1", "127.80.1.3")
    gone["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    done = pod("job-2", "127.80.1.4")
    done["status"]["phase"] = "Succeeded"
    stranger = pod("job-4", "127.80.1.6")
    stranger["metadata"]["labels"] = {"job": "another"}
    pods = [pod("job-0", "127.80.1.2"), gone, done, pod("job-3", "127.80.1.5", ready=True), stranger]
    strict = dns.records(pods, [service(not_ready=False)])
    assert strict["job-workers.team.svc.cluster.local"] == ("127.80.1.5",)  # only the Ready one
    assert NAME not in strict
    loose = dns.records(pods, [service()])
    assert loose["job-workers.team.svc.cluster.local"] == ("127.80.1.2", "127.80.1.5")
    # A Service without a selector selects nothing (its Endpoints would be someone's own).
    bare = service()
    del bare["spec"]["selector"]
    assert NAME not in dns.records(pods, [bare])
    assert dns.records([], []) == {"cluster.local": (), "svc.cluster.local": ()}


def ask(name: str, recs: dns.Records, qtype: int = dns.TYPE_A) -> tuple[int, list[str]]:
    return dns.parse_response(dns.answer(dns.parse_query(dns.encode_query(name, qtype)), recs))


def test_answers_known_unknown_and_outside_names() -> None:
    recs = dns.records([pod("job-0", "127.80.1.2")], [service()])
    assert ask(NAME + ".", recs) == (dns.NOERROR, ["127.80.1.2"])
    assert ask(NAME.upper(), recs) == (dns.NOERROR, ["127.80.1.2"])
    assert ask(NAME, recs, qtype=28) == (dns.NOERROR, [])  # AAAA: the name exists, without such records
    assert ask("job-9.job-workers.team.svc.cluster.local", recs) == (dns.NXDOMAIN, [])
    assert ask(NAME + ".team.svc.cluster.local", recs) == (dns.NXDOMAIN, [])  # a search-list try
    assert ask("example.com", recs) == (dns.REFUSED, [])  # nothing is forwarded
    assert ask("evilcluster.local", recs) == (dns.REFUSED, [])
    other_opcode = dns.parse_query(dns.encode_query(NAME))
    status = dns.Query(other_opcode.id, 0x2800, NAME, dns.TYPE_A, dns.CLASS_IN, other_opcode.question)
    assert dns.parse_response(dns.answer(status, recs))[0] == dns.NOTIMP


def test_server_lists_at_most_every_max_age_and_survives_a_failing_apiserver() -> None:
    clock = [100.0]
    listings: list[Any] = [([pod("job-0", "127.80.1.2")], [service()])]
    calls = []

    def lister() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        calls.append(clock[0])
        got = listings[0]
        if isinstance(got, Exception):
            raise got
        return got  # type: ignore[no-any-return]

    server = dns.ClusterDns(lister, lambda: clock[0])
    query = dns.encode_query(NAME)
    assert server.respond(b"junk") is None
    assert dns.parse_response(server.respond(query) or b"") == (dns.NOERROR, ["127.80.1.2"])
    clock[0] += dns.MAX_AGE / 2
    listings[0] = ([pod("job-0", "127.80.3.3")], [service()])
    assert dns.parse_response(server.respond(query) or b"")[1] == ["127.80.1.2"]  # still the first listing
    assert len(calls) == 1
    clock[0] += dns.MAX_AGE
    assert dns.parse_response(server.respond(query) or b"")[1] == ["127.80.3.3"]  # the pod was replaced
    clock[0] += dns.MAX_AGE * 2
    listings[0] = ConnectionError("apiserver gone")
    assert dns.parse_response(server.respond(query) or b"")[1] == ["127.80.3.3"]  # the last listing answers
    assert (
        dns.parse_response(dns.ClusterDns(lister, lambda: clock[0]).respond(query) or b"")[0] == dns.SERVFAIL
    )  # none yet


def test_kubelet_points_pods_at_the_sets_dns(tmp_path: Path) -> None:
    conf = kubelet_config(NodeAddresses(3, 2), 1, 2, tmp_path / "ca.crt", "run1")
    assert conf["clusterDNS"] == ["127.83.0.1"]
    assert conf["clusterDomain"] == "cluster.local" == dns.DOMAIN
