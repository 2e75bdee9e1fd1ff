"""Leader election on a Lease: the pure decisions, and the elector against an in-memory Lease store.

The store keeps a ``resourceVersion`` and refuses a stale write (409) as the
apiserver does; clocks are plain numbers moved by the test, so a freeze of
any length takes no time.
"""

from __future__ import annotations

import json
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from spotguard.operator.leader import (
    JITTER_FACTOR,
    LeaderElector,
    LostLease,
    Observation,
    Record,
    Timing,
    decide,
    fenced,
    jittered,
    micro_time,
    new_identity,
    observe,
    pod_of,
    released,
)

WALL = datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
T = Timing()  # client-go's defaults: 15 s, 10 s, 2 s


def held_by(holder: str, renew: str = "2030-01-01T00:00:00.000000Z", duration: int = 15, moves: int = 0) -> Record:
    return Record(holder, duration, "2030-01-01T00:00:00.000000Z", renew, moves)


# --- pure --------------------------------------------------------------------------


def test_timing_defaults_are_client_gos_and_bad_ones_are_explained() -> None:
    assert (T.lease_duration, T.renew_deadline, T.retry_period) == (15, 10.0, 2.0)
    assert T.problem() is None
    assert "longer than the renew deadline" in (Timing(10, 10, 2).problem() or "")
    assert "1.2 x the retry period" in (Timing(15, 2.4, 2).problem() or "")
    assert Timing(15, 2.41, 2).problem() is None
    assert "positive" in (Timing(0, 10, 2).problem() or "")
    assert "positive" in (Timing(15, 10, 0).problem() or "")


def test_a_missing_lease_is_created_with_this_replica_as_holder() -> None:
    step = decide(Observation(None, 0.0), "me", 0.0, WALL, T)
    assert step.action == "create"
    assert step.record == Record("me", 15, "2030-01-02T03:04:05.678901Z", "2030-01-02T03:04:05.678901Z", 0)


def test_expiry_runs_from_the_last_change_this_replica_saw_never_from_the_records_times() -> None:
    # The record says it was renewed in 2030 (another machine's clock): irrelevant. Seen first at 100.
    seen = observe(None, held_by("other"), 100.0)
    assert decide(seen, "me", 100.0, WALL, T).action == "wait"
    step = decide(seen, "me", 114.9, WALL, T)
    assert step.action == "wait" and step.expires_in == pytest.approx(0.1)
    # Unchanged records keep the first sighting's time; expiry comes 15 s after it.
    assert observe(seen, held_by("other"), 110.0) is seen
    step = decide(observe(seen, held_by("other"), 115.0), "me", 115.0, WALL, T)
    assert step.action == "acquire"
    assert step.record == Record("me", 15, "2030-01-02T03:04:05.678901Z", "2030-01-02T03:04:05.678901Z", 1)
    # A record written years "ago" by a skewed clock is still waited for in full.
    old = observe(None, held_by("other", renew="1999-01-01T00:00:00.000000Z"), 200.0)
    assert decide(old, "me", 214.0, WALL, T).action == "wait"


def test_a_live_holder_keeps_its_lease() -> None:
    seen = observe(None, held_by("other", renew="r0"), 0.0)
    for i in range(1, 50):  # it renews every 2 s; the standby looks every 2 s for 98 s
        seen = observe(seen, held_by("other", renew=f"r{i}"), i * 2.0)
        assert seen.at == i * 2.0
        assert decide(seen, "me", i * 2.0 + 1.9, WALL, T).action == "wait"


def test_the_holders_own_duration_counts() -> None:
    seen = observe(None, held_by("other", duration=40), 0.0)
    assert decide(seen, "me", 39.0, WALL, T).action == "wait"
    assert decide(seen, "me", 40.0, WALL, T).action == "acquire"


def test_a_released_lease_is_taken_at_once() -> None:
    gone = released(held_by("other", moves=3), WALL)
    assert gone == Record("", 1, micro_time(WALL), micro_time(WALL), 3)
    assert gone.spec()["holderIdentity"] is None
    step = decide(observe(None, gone, 50.0), "me", 50.0, WALL, T)
    assert step.action == "acquire" and step.record is not None and step.record.transitions == 4


def test_the_holder_renews_keeping_its_acquire_time() -> None:
    step = decide(observe(None, held_by("me", moves=2), 0.0), "me", 99.0, WALL, T, leading=True)
    assert step.action == "renew"
    assert step.record == Record("me", 15, "2030-01-01T00:00:00.000000Z", micro_time(WALL), 2)


@pytest.mark.parametrize("found", [None, held_by("other"), released(held_by("me"), WALL)])
def test_a_leader_that_finds_the_lease_not_its_own_has_lost_it(found: Record | None) -> None:
    # Even a released or deleted Lease is never taken back: the leader may have acted without it.
    assert decide(observe(None, found, 0.0), "me", 0.0, WALL, T, leading=True).action == "lost"


def test_fenced_after_the_renew_deadline_on_the_monotonic_clock() -> None:
    assert fenced(None, 0.0, 10.0)
    assert not fenced(100.0, 109.99, 10.0)
    assert fenced(100.0, 110.0, 10.0)
    assert fenced(100.0, 1000.0, 10.0)  # continued after a long freeze


def test_identity_is_the_pod_and_a_fresh_suffix() -> None:
    a, b = new_identity("op-7d9f-x2"), new_identity("op-7d9f-x2")
    assert a != b and pod_of(a) == pod_of(b) == "op-7d9f-x2"
    assert new_identity("p", "abc") == "p_abc"


def test_jitter_stays_within_client_gos_factor() -> None:
    assert jittered(2.0, lambda: 0.0) == 2.0
    assert jittered(2.0, lambda: 1.0) == pytest.approx(2.0 * JITTER_FACTOR)


def test_micro_time_is_a_kubernetes_micro_time() -> None:
    assert micro_time(datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)) == "2030-01-02T03:04:05.000000Z"


# --- the elector against an in-memory Lease -------------------------------------------


class ApiError(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class Response:
    def __init__(self, doc: dict[str, Any]) -> None:
        self.data = json.dumps(doc).encode()


class Leases:
    """One namespace's Leases with the apiserver's optimistic concurrency."""

    def __init__(self) -> None:
        self.items: dict[str, dict[str, Any]] = {}
        self.version = 0
        self.lock = threading.Lock()
        self.writes: list[tuple[str, str | None]] = []  # (name, holder) of each accepted write
        #: Called after a read has taken its copy (to interleave two candidates).
        self.after_read: Any = None
        self.down = False

    def _store(self, name: str, body: dict[str, Any]) -> None:
        self.version += 1
        body = json.loads(json.dumps(body))
        body["metadata"]["resourceVersion"] = str(self.version)
        self.items[name] = body
        self.writes.append((name, body["spec"].get("holderIdentity")))

    def read_namespaced_lease(self, name: str, namespace: str, **_: Any) -> Response:
        if self.down:
            raise ApiError(503)
        with self.lock:
            if name not in self.items:
                raise ApiError(404)
            doc = json.loads(json.dumps(self.items[name]))
        if self.after_read is not None:
            self.after_read()
        return Response(doc)

    def create_namespaced_lease(self, namespace: str, body: dict[str, Any], **_: Any) -> Response:
        with self.lock:
            name = body["metadata"]["name"]
            if name in self.items:
                raise ApiError(409)
            self._store(name, body)
            return Response(self.items[name])

    def replace_namespaced_lease(self, name: str, namespace: str, body: dict[str, Any], **_: Any) -> Response:
        if self.down:
            raise ApiError(503)
        with self.lock:
            if name not in self.items:
                raise ApiError(404)
            if body["metadata"].get("resourceVersion") != self.items[name]["metadata"]["resourceVersion"]:
                raise ApiError(409)
            self._store(name, body)
            return Response(self.items[name])

    def holder(self, name: str = "lead") -> str | None:
        return self.items[name]["spec"].get("holderIdentity") if name in self.items else None


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def lost(reason: str) -> None:
    raise LostLease(reason)


def elector(leases: Leases, identity: str, clock: Clock, timing: Timing = T) -> LeaderElector:
    # The wall clock moves with the monotonic one here (each renewal writes a new renewTime).
    return LeaderElector(
        leases,
        "ops",
        "lead",
        identity,
        timing,
        clock=clock,
        wall=lambda: WALL + timedelta(seconds=clock.now),
        on_lost=lost,
    )


def test_the_first_candidate_creates_the_lease_the_second_stands_by() -> None:
    leases, clock = Leases(), Clock()
    a, b = elector(leases, "a_1", clock), elector(leases, "b_1", clock)
    assert a.try_acquire_or_renew().action == "create" and a.leading
    assert b.try_acquire_or_renew().action == "wait" and not b.leading and b.holder == "a_1"
    clock.now = 2.0
    assert a.try_acquire_or_renew().action == "renew" and a.renewed_at == 2.0
    assert leases.holder() == "a_1" and leases.items["lead"]["spec"]["leaseTransitions"] == 0


def test_two_candidates_on_an_expired_lease_one_wins() -> None:
    leases, clock = Leases(), Clock()
    dead = elector(leases, "dead_1", clock)
    dead.try_acquire_or_renew()
    a, b = elector(leases, "a_1", clock), elector(leases, "b_1", clock)
    a.try_acquire_or_renew()
    b.try_acquire_or_renew()
    clock.now = 20.0
    # Both read the same expired record before either writes.
    barrier = threading.Barrier(2, timeout=10)
    leases.after_read = barrier.wait
    threads = [threading.Thread(target=c.try_acquire_or_renew) for c in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert [a.leading, b.leading].count(True) == 1
    winner = "a_1" if a.leading else "b_1"
    assert leases.holder() == winner and leases.items["lead"]["spec"]["leaseTransitions"] == 1
    assert [h for _, h in leases.writes] == ["dead_1", winner]


def test_a_frozen_leader_is_replaced_and_fenced_when_it_is_continued() -> None:
    leases, clock = Leases(), Clock()
    a, b = elector(leases, "a_1", clock), elector(leases, "b_1", clock)
    a.try_acquire_or_renew()  # a leads from 0
    for t in (0.5, 2.0):
        clock.now = t
        if t == 2.0:
            a.try_acquire_or_renew()  # its last renewal, sent at 2
        b.try_acquire_or_renew()
    a.fence()  # fine: renewed 0 s ago
    # a is frozen at 2.x; b sees no change after 2.0 and takes over at 17.
    clock.now = 16.9
    assert b.try_acquire_or_renew().action == "wait"
    clock.now = 17.0
    assert b.try_acquire_or_renew().action == "acquire" and b.leading
    # a is continued at 30: its first write for a job is refused, and its renewal finds the Lease lost.
    clock.now = 30.0
    with pytest.raises(LostLease, match="last renewed 28.0 s ago"):
        a.fence()
    with pytest.raises(LostLease):  # nor does it try to renew
        a.try_acquire_or_renew()
    assert leases.holder() == "b_1"
    # Its fence fired long before b could take over: at 12 (renewed at 2, deadline 10) versus 17.
    clock.now = 11.99
    a.fence()
    clock.now = 12.0
    with pytest.raises(LostLease):
        a.fence()


def test_a_leader_frozen_between_reading_and_renewing_sends_nothing() -> None:
    leases, clock = Leases(), Clock()
    a = elector(leases, "a_1", clock)
    a.try_acquire_or_renew()
    writes = len(leases.writes)

    def frozen_now() -> None:
        clock.now = 30.0

    leases.after_read = frozen_now
    with pytest.raises(LostLease):
        a.try_acquire_or_renew()
    assert len(leases.writes) == writes  # not even a renewal that the apiserver would refuse


def test_the_renewal_thread_exits_after_the_renew_deadline_without_a_renewal() -> None:
    leases, clock = Leases(), Clock()
    fast = Timing(3, 2.0, 0.01)
    reasons: list[str] = []
    a = LeaderElector(leases, "ops", "lead", "a_1", fast, clock=clock, wall=lambda: WALL, on_lost=reasons.append)
    a.try_acquire_or_renew()
    leases.down = True  # the apiserver is away
    a.start_renewing()
    clock.now = 2.5
    thread = a._thread
    assert thread is not None
    thread.join(5)
    assert not thread.is_alive()
    assert reasons and "renew deadline 2 s" in reasons[0]


def test_the_renewal_thread_exits_when_another_holds_the_lease() -> None:
    leases, clock = Leases(), Clock()
    fast = Timing(3, 2.0, 0.01)
    reasons: list[str] = []
    a = LeaderElector(leases, "ops", "lead", "a_1", fast, clock=clock, wall=lambda: WALL, on_lost=reasons.append)
    a.try_acquire_or_renew()
    lease = leases.items["lead"]
    leases.replace_namespaced_lease("lead", "ops", {**lease, "spec": {**lease["spec"], "holderIdentity": "b_1"}})
    a.start_renewing()
    thread = a._thread
    assert thread is not None
    thread.join(5)
    assert reasons == ["the Lease ops/lead is held by b_1"]


def test_release_hands_over_at_once() -> None:
    leases, clock = Leases(), Clock()
    a, b = elector(leases, "a_1", clock), elector(leases, "b_1", clock)
    a.try_acquire_or_renew()
    clock.now = 1.0
    b.try_acquire_or_renew()
    a.release()
    assert leases.holder() is None and leases.items["lead"]["spec"]["leaseDurationSeconds"] == 1
    assert not a.leading
    assert b.try_acquire_or_renew().action == "acquire" and b.leading  # no wait for the 15 s
    a.release()  # twice, or after losing: nothing written
    assert leases.holder() == "b_1"


def test_acquire_waits_until_stopped() -> None:
    leases, clock = Leases(), Clock()
    elector(leases, "a_1", clock).try_acquire_or_renew()
    b = elector(leases, "b_1", clock, Timing(15, 10, 0.01))
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    assert b.acquire(stop) is False and not b.leading


def test_a_bad_timing_is_refused() -> None:
    with pytest.raises(ValueError, match="longer than the renew deadline"):
        LeaderElector(Leases(), "ops", "lead", "a_1", Timing(5, 5, 1))
