"""Real nodes: kubelet v1.20 + containerd 1.6 + runc + CNI on this machine, for tests and the dev cluster.

The process node (:mod:`testenv.processnode`) is the cheap stand-in for a
kubelet; a real node is the real thing, for the tests that must see what a
cluster does to a pod (images, the sandbox, cgroups, kubelet's own status,
logs and termination messages, its handling of grace periods):

- per node, one containerd (its root, state, sockets under the node's state
  directory; CRI set up for a root without CAP_SYS_RESOURCE, AppArmor or
  systemd) and one kubelet (its own address ``127.0.<100+k>.<i>``, which is
  the Node's name and InternalIP, port, root and cert directories, and a
  cgroupRoot of its own in every cgroup v1 hierarchy), both in a mount
  namespace of the node's where the kubelet's fixed paths (/var/lib/kubelet,
  /var/log/pods, /var/log/containers) are the node's own;
- pod networks: the CNI bridge and host-local plugins, every pod an IP of its
  node's range in the set's 127.<80+k>.0.0/16 on one bridge, so pods on
  different nodes talk TCP (torchrun's rendezvous) without the host forwarding
  anything; see :mod:`testenv.realnode.config`;
- nodes look like the process nodes' spot GPU nodes to the scheduler: the same
  labels (and taint, if asked), and ``nvidia.com/gpu`` capacity on the Node's
  status, which the kubelet's own status updates keep;
- images: ``pause`` (the sandbox) and ``busybox`` come as archives, imported
  into each node; the project's images from a plain-http registry on
  127.0.0.1 (``registry=``);
- node loss (:meth:`RealNodes.kill`): kubelet, containerd, shims and
  containers SIGKILLed at once, the Node object deleted (as the process
  node's ``kill`` does, and a cloud provider does for a gone instance);
- teardown (:meth:`RealNodes.stop`) leaves nothing: no processes, mounts,
  cgroups, links, nothing under /var/lib/kubelet, /var/log/pods,
  /var/lib/cni, /run/containerd, and no host-wide sysctl or iptables change
  (:mod:`testenv.realnode.host`).

- host services (:mod:`testenv.realnode.hostnet`): a pod reaches the
  apiserver through the ``kubernetes`` Service's ``10.0.0.1:443`` (what the
  kubelet puts into ``KUBERNETES_SERVICE_HOST/PORT``; its serving cert lists
  that address) and the test world's services at ``127.0.0.1:<port>`` (the
  object store, a test's own server), each once its port is in the
  host-services allow list (:mod:`testenv.processnode.hostservices`, the
  process nodes' too; ``host_services=``), also when registered while the pod
  runs. A chained CNI plugin (:mod:`testenv.realnode.cniplugin`) rewrites
  those connections inside the pod's namespace to the set's bridge gateway,
  where a proxy of the set forwards them to the host's 127.0.0.1; no host-wide
  nft rule or sysctl. A pod's own 127.0.0.1 listeners work as before (except
  on a port the allow list names: that one is the host's).

- cluster DNS (:mod:`testenv.realnode.dns`): pods of a headless Service with
  ``hostname`` and ``subdomain`` (a multi-node TrainingJob's ranks) resolve
  one another's ``<hostname>.<subdomain>.<ns>.svc.cluster.local``; a server of
  the set on UDP/TCP port 53 of its bridge gateway, which every node's kubelet
  names as ``clusterDNS``, answers from the pods the apiserver lists (the
  Endpoints controller refuses 127.0.0.0/8 pod IPs). Other names in
  ``cluster.local`` are NXDOMAIN, names outside it are refused: nothing is
  forwarded.

- the apiserver's way to Services (:mod:`testenv.realnode.svcproxy`, a
  service of every test control plane): its ``cluster`` egress goes through
  a CONNECT proxy that routes a Service's ClusterIP to a Ready pod's IP and
  target port, as kube-proxy would, so a webhook configured by its Service
  (the chart's) is called on a pod of these nodes.

Not there (yet): kube-proxy; pods reach no Service IP but the ``kubernetes`` one.

    nodes = RealNodes.start(kubeconfig, kubelet_client_ca, state_dir, count=2)
    nodes.kill(nodes.node_names()[0])
    nodes.stop()
"""

from testenv.realnode.nodes import GPU, RealNode, RealNodes, kubelet_path

__all__ = ["GPU", "RealNode", "RealNodes", "kubelet_path"]
