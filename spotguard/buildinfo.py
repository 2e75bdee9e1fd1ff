"""``spotguard_build_info``: which spotguard (and Python) a process runs, as Prometheus expects it.

A gauge fixed at 1 whose labels carry the versions, the convention of
``prometheus_build_info`` and ``kube-state-metrics``' ``*_build_info``: join
on it to see which version each target runs, or alert on a fleet that runs
two at once. Standard library and prometheus-client only.
"""

from __future__ import annotations

import platform

from prometheus_client import CollectorRegistry, Gauge

from spotguard.version import __version__

#: Which part of spotguard the process is (bounded).
COMPONENTS = ("operator", "sidecar", "run")


def build_info(registry: CollectorRegistry, component: str) -> Gauge:
    """Register ``spotguard_build_info{version, python, component}`` = 1 in ``registry``."""
    if component not in COMPONENTS:
        raise ValueError(f"unknown component {component!r}; one of {COMPONENTS}")
    gauge = Gauge(
        "spotguard_build_info",
        "spotguard's version and Python's, always 1.",
        ["version", "python", "component"],
        registry=registry,
    )
    gauge.labels(__version__, platform.python_version(), component).set(1)
    return gauge
