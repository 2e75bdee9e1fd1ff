"""The fault proxy's pure parts: which rule applies to a request, and the request log."""

from __future__ import annotations

from testenv.faultproxy import (
    Record,
    Rule,
    flip_middle_byte,
    hold,
    pick_rule,
    reset,
    s3_error,
    status,
)


def test_the_first_live_matching_rule_applies_and_counts_its_hits() -> None:
    slow = Rule(status(503, "SlowDown"), method="PUT", path=r"/manifest\.json$", times=2)
    cut = Rule(reset())
    rules = [slow, cut]
    assert pick_rule(rules, "GET", "/b/job/ckpt-1/manifest.json", 0.0) is cut  # method differs
    assert pick_rule(rules, "put", "/b/job/ckpt-1/manifest.json", 0.0) is slow  # case-insensitive
    assert pick_rule(rules, "PUT", "/b/job/ckpt-1/manifest.json", 0.0) is slow
    assert pick_rule(rules, "PUT", "/b/job/ckpt-1/manifest.json", 0.0) is cut  # slow is used up
    assert (slow.hits, cut.hits) == (2, 2)


def test_a_time_window_ends() -> None:
    rule = Rule(status(), until=10.0)
    assert pick_rule([rule], "PUT", "/b/k", 9.9) is rule
    assert pick_rule([rule], "PUT", "/b/k", 10.0) is None
    assert not rule.live(10.0)


def test_skip_lets_the_first_matches_pass() -> None:
    rule = Rule(hold(), method="POST", path=r"\?delete", times=1, skip=1)
    assert pick_rule([rule], "POST", "/b?delete", 0.0) is None
    assert pick_rule([rule], "POST", "/b?delete", 0.0) is rule
    assert pick_rule([rule], "POST", "/b?delete", 0.0) is None


def test_no_rules_no_fault() -> None:
    assert pick_rule([], "GET", "/b/k", 0.0) is None


def test_record_key_and_query() -> None:
    rec = Record(0.0, "PUT", "/bucket/job/ckpt-000000000001/model.safetensors?uploadId=x&partNumber=2", None)
    assert rec.key == "job/ckpt-000000000001/model.safetensors"
    assert rec.query == "uploadId=x&partNumber=2"
    listing = Record(0.0, "GET", "/bucket?list-type=2&prefix=job%2F", None)
    assert listing.key == "" and listing.query.startswith("list-type=2")


def test_corruption_flips_exactly_one_byte() -> None:
    body = bytes(range(10))
    bad = flip_middle_byte(body)
    assert len(bad) == len(body) and sum(a != b for a, b in zip(body, bad, strict=True)) == 1
    assert flip_middle_byte(b"") == b""


def test_error_documents_name_the_code() -> None:
    assert b"<Code>SlowDown</Code>" in s3_error("SlowDown", 503)
