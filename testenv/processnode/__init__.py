"""Process node: a test-support stand-in for kubelet.

There is no kubelet or container runtime in the test environment, so this agent
registers Node objects with a real kube-apiserver (spot GPU pool labels, GPU
capacity, Ready condition, node-status and Lease heartbeats) and runs each pod
bound to its nodes as local processes:

- init containers in order, then the containers concurrently, each in its own
  process group and (as root) its own PID namespace, where its command is PID 1
  and a fresh ``/proc`` shows only that namespace, as in a container; with
  ``shareProcessNamespace: true`` the pod's containers share one namespace whose
  PID 1 is a sandbox process (kubelet's "pause"); ``command`` + ``args`` only (there are no images), ``env`` and
  ``envFrom`` (plain values, downward API fields, Secret and ConfigMap keys),
  ``workingDir``;
- volumes (``emptyDir``, ``hostPath``, ``secret``, ``configMap``,
  ``downwardAPI``, ``projected``) bind-mounted at their ``mountPath`` inside a
  private mount namespace per container (needs root), with a private ``/dev``
  (the usual devices, GPUs, a ``/dev/shm`` tmpfs); mount sources are opened
  before anything is mounted, so an emptyDir at ``/tmp`` hides none of them;
- termination messages like kubelet: a fresh file per run at
  ``terminationMessagePath`` (default ``/dev/termination-log``, inside the
  private ``/dev``, never the host's), whose last 4096 bytes become
  ``terminated.message``; ``FallbackToLogsOnError`` uses the run's log (last 80
  lines, at most 2048 bytes) after a failure with an empty file; a command that
  cannot be executed ends ``StartError`` with exit code 128;
- pod and container status like kubelet (Pending, Running, Succeeded/Failed,
  exit codes, reasons), restart policies, graceful deletion (SIGTERM to the
  container's main process only, which as PID 1 ignores it without a handler;
  wait ``terminationGracePeriodSeconds``, SIGKILL, then delete with grace 0);
- pod networking like kubelet with a CNI plugin: every pod without
  ``hostNetwork`` gets a sandbox process (kubelet's "pause") holding the pod's
  network and UTS namespaces, which its containers join: its own ``lo`` (so
  127.0.0.1 inside is the pod's own), ``eth0`` with a pod IP in 127.64.0.0/16
  on a veth pair to the machine's bridge ``sgpod0`` (127.64.0.1), reachable
  from the host and from every pod of every process node on the machine, and
  the hostname ``spec.hostname`` or the pod name. ``status.podIP``/``podIPs``
  and the downward API report that IP (hostNetwork pods: the node's 127.0.0.1
  and the host's network and hostname, as before). ``ProcessNodes.pod_ip``
  finds it for tests. IPs are unique across the agents of a machine (a table
  under a lock) and freed with the pod's sandbox when the pod ends or goes;
  what a crashed agent left is reclaimed by the next one, and only that: every
  link records the agent that made it, so agents of several test worlds run
  side by side. The host's own settings are left alone (``route_localnet`` is
  set on the bridge only, which goes with the last agent);
- name resolution like kubelet + cluster DNS: a per-pod ``/etc/hosts``
  bind-mounted into every container with ``localhost``, the pod's own IP and
  names, and, standing in for the DNS of headless Services, every pod of the
  cluster with ``spec.hostname`` H, ``spec.subdomain`` S and an IP as
  ``H.S.NS.svc.cluster.local`` / ``H.S.NS.svc`` (and ``H.S`` in its own
  namespace NS), from the moment it has an IP until it has ended
  (``publishNotReadyAddresses``); the agent watches all pods and rewrites the
  files in place;
- the cluster's services are reachable from pods, and nothing else of the
  host: the test world's services listen on the host's 127.0.0.1 and are
  handed to pods as ``http://127.0.0.1:PORT``; each pod's sandbox mirrors the
  host listeners at allowed ports only (the apiserver's, ``--host-service
  PORT``, and the ports registered in the host-services directory, see
  ``hostservices``; refreshed every 0.5 s) on the pod's own 127.0.0.1 and
  forwards connections to the host (``splice``), so those URLs work unchanged
  inside pods, also for services started or registered later. etcd, the
  agent's control port and a test's own servers are not reachable unless
  registered (``ProcessNodes.host_services``); every other port is the pod's own;
- the three ways a spot node dies, on request: ``drain`` (cordon + eviction
  API), ``shutdown`` (graceful node shutdown: pods end ``Failed`` /
  ``Terminated`` with a ``DisruptionTarget`` condition) and ``kill`` (processes
  SIGKILLed, heartbeats stop, Node deleted, a fresh node joins).

Differences from a real runtime: without root there are no namespaces (no
pod network either: every pod shares the host's, podIP 127.0.0.1), and
SIGTERM goes to the container's whole process group. Pod networks stay inside
127.0.0.0/8 on purpose: no packet can leave the machine, nothing collides with
the machine's own addresses, and the host routes to pod IPs over the bridge
(``route_localnet`` lets 127/8 addresses live on a non-loopback interface).
There is no DNS server and no Service IP (no kube-proxy): the hosts files
stand in for headless Services only, and the apiserver is reached at the
host's address through the listener mirror (``KUBERNETES_SERVICE_HOST``
127.0.0.1); a pod cannot bind 127.0.0.1 at an allowed port where the host
listens (the mirror holds it). The root filesystem is the host's, so mount points outside ``/dev`` and outside
volumes (directories, an empty file for a termination message path elsewhere)
are created on the host and stay; ``/dev/shm`` is per container, not per pod. Not
emulated: images, probes (a running container is ready), lifecycle hooks,
resource limits, token refresh for projected ServiceAccount
tokens. ``subPathExpr`` is expanded from the container's environment as
kubelet does; ``securityContext.readOnlyRootFilesystem`` makes the root
read-only in the container's mount namespace (its volumes, ``/dev`` and the
kernel's filesystems stay writable; no ``TMPDIR`` is set for it, so ``/tmp``
is whatever the pod mounts there); the other ``securityContext`` fields
(the user, capabilities, seccomp) are not applied. Host directories given
with ``--writable-host-path`` (the test world's files, such as a ``file://``
store) are bound at their own path into every container with a read-only
root, so that neither the root nor a volume above them (an emptyDir at
``/tmp``) hides them. Container logs go to
``<state-dir>/pods/<namespace>_<pod>/<container>.log``.

    python -m testenv.processnode run --kubeconfig K --nodes 2 --state-dir D
    python -m testenv.processnode preempt --state-dir D --pod NAME --mode drain|shutdown|kill
    python -m testenv.processnode nodes --state-dir D

One module per idea: ``api`` (apiserver access), ``podspec`` (pure reading of
a pod spec), ``container`` (what a container process sets up before its
command: namespaces, mounts), ``processes`` (forking and signalling),
``pod`` (the pod runner and its status), ``podnet`` (pod network namespaces,
IPs, the host-service mirror), ``hostservices`` (the host ports pods may
reach), ``hosts`` (per-pod hosts files), ``node`` (Node objects and
heartbeats), ``agent`` (the node agent), ``control`` (the control API, server
and client), ``cli``. The names tests and tools use are re-exported here.
"""

import importlib
from typing import TYPE_CHECKING, Any

# Re-exports, resolved on first use: a container's launcher imports only the
# ``container`` module, and stays small for as long as the container runs.
_EXPORTS = {
    "Agent": "agent",
    "ApiError": "api",
    "Kube": "api",
    "main": "cli",
    "LOOPBACK": "common",
    "MODES": "common",
    "SHUTDOWN_MESSAGE": "common",
    "SHUTDOWN_REJECT_MESSAGE": "common",
    "PreemptError": "common",
    "LaunchSpec": "container",
    "container_init": "container",
    "launch_argv": "container",
    "ProcessNodes": "control",
    "NodeSettings": "node",
    "ProcessNode": "node",
    "node_manifest": "node",
    "PodRunner": "pod",
    "expand_vars": "podspec",
    "field_value": "podspec",
    "log_tail": "podspec",
    "projected_items": "podspec",
    "safe_relpath": "podspec",
    "kill_recorded_processes": "processes",
}

if TYPE_CHECKING:
    from testenv.processnode.agent import Agent
    from testenv.processnode.api import ApiError, Kube
    from testenv.processnode.cli import main
    from testenv.processnode.common import LOOPBACK, MODES, SHUTDOWN_MESSAGE, SHUTDOWN_REJECT_MESSAGE, PreemptError
    from testenv.processnode.container import LaunchSpec, container_init, launch_argv
    from testenv.processnode.control import ProcessNodes
    from testenv.processnode.node import NodeSettings, ProcessNode, node_manifest
    from testenv.processnode.pod import PodRunner
    from testenv.processnode.podspec import expand_vars, field_value, log_tail, projected_items, safe_relpath
    from testenv.processnode.processes import kill_recorded_processes


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = [
    "LOOPBACK",
    "MODES",
    "SHUTDOWN_MESSAGE",
    "SHUTDOWN_REJECT_MESSAGE",
    "Agent",
    "ApiError",
    "Kube",
    "LaunchSpec",
    "NodeSettings",
    "PodRunner",
    "PreemptError",
    "ProcessNode",
    "ProcessNodes",
    "container_init",
    "expand_vars",
    "field_value",
    "kill_recorded_processes",
    "launch_argv",
    "log_tail",
    "main",
    "node_manifest",
    "projected_items",
    "safe_relpath",
]
