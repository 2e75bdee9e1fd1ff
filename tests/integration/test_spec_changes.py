"""A spec change a running job must not take is refused by the operator itself, with no webhook installed.

The webhook refuses such an update at once when it is installed and reachable
(``test_admission``); here nothing refuses it at the apiserver, as when the
webhook is off, down (its failure policy is ``Ignore``) or bypassed. The
operator keeps running the job with the values it runs with, and says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from spotguard.contract import env
from spotguard.operator.specchange import ALLOW_RESTART_ANNOTATION
from spotguard.operator.testing import OperatorProcess
from testenv.kubetest import (
    GROUP,
    PLURAL,
    VERSION,
    cond,
    create_job,
    fail_pod,
    get_job,
    no_node_job,
    run_pod,
    wait_event,
    wait_status,
)

pytestmark = pytest.mark.integration

#: The namespace of this module (the ``ns`` fixture).
NS_PREFIX = "specchg"


def storage_of(apis: tuple[Any, Any], ns: str, pod: str) -> set[str]:
    """The checkpoint roots the pod's containers are given."""
    core, _ = apis
    spec = core.read_namespaced_pod(pod, ns).spec
    return {
        e.value
        for c in [*(spec.init_containers or []), *spec.containers]
        for e in c.env or []
        if e.name == env.STORAGE_URI.name
    }


def test_a_storage_change_of_a_running_job_is_not_acted_on_until_allowed(
    apis: tuple[Any, Any], ns: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    _, custom = apis
    first, second = f"file://{tmp_path}/a", f"file://{tmp_path}/b"
    preemption = {"maxPreemptions": 3, "backoffLimit": 3, "gracePeriodSeconds": 5, "backoff": {"initialSeconds": 0}}
    create_job(apis, ns, no_node_job("moved", first, preemption=preemption))
    wait_status(apis, ns, "moved", "attempt 1", lambda s: s.get("attempt") == 1)
    run_pod(apis, ns, "moved-a1")
    wait_status(apis, ns, "moved", "Running", lambda s: s.get("phase") == "Running")
    assert storage_of(apis, ns, "moved-a1") == {f"{first}/{ns}/moved"}

    # Nothing at the apiserver refuses it (no webhook here): the spec changes.
    custom.patch_namespaced_custom_object(
        GROUP, VERSION, ns, PLURAL, "moved", {"spec": {"checkpoint": {"storage": second}}}
    )
    assert get_job(apis, ns, "moved")["spec"]["checkpoint"]["storage"] == second
    st = wait_status(
        apis, ns, "moved", "SpecChangeRefused", lambda s: cond(s, "SpecChangeRefused").get("status") == "True"
    )
    message = cond(st, "SpecChangeRefused")["message"]
    assert f"spec.checkpoint.storage from {first} to {second} would restart training from nothing" in message
    assert f"{ALLOW_RESTART_ANNOTATION}=true" in message, message
    assert st["runsWith"]["storage"] == first and st["phase"] == "Running"
    wait_event(apis, ns, "moved", "the refusal's Event", lambda t, r, m: t == "Warning" and r == "SpecChangeRefused")

    # The next attempt resumes from where the checkpoints are, not from nothing.
    fail_pod(apis, ns, "moved-a1")
    wait_status(apis, ns, "moved", "attempt 2", lambda s: s.get("attempt") == 2)
    assert storage_of(apis, ns, "moved-a2") == {f"{first}/{ns}/moved"}

    # Made on purpose: the change applies from the next attempt on.
    custom.patch_namespaced_custom_object(
        GROUP, VERSION, ns, PLURAL, "moved", {"metadata": {"annotations": {ALLOW_RESTART_ANNOTATION: "true"}}}
    )
    st = wait_status(
        apis, ns, "moved", "the change applied", lambda s: cond(s, "SpecChangeRefused").get("status") == "False"
    )
    assert cond(st, "SpecChangeRefused")["reason"] == "SpecChangeApplied" and st["runsWith"]["storage"] == second
    fail_pod(apis, ns, "moved-a2")
    wait_status(apis, ns, "moved", "attempt 3", lambda s: s.get("attempt") == 3)
    assert storage_of(apis, ns, "moved-a3") == {f"{second}/{ns}/moved"}
