"""The TrainingJob spec model: typed, frozen, parsed once, with field paths in errors.

The CRD's OpenAPI schema refuses most bad specs at the apiserver; ``parse`` checks
the same rules again (old servers ignore some schema features, and the webhook
parses pod annotations with it), plus the rules a schema cannot express.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from spotguard.checkpoint.store.retention import RetentionPolicy
from spotguard.operator.specfields import (
    DNS_SUBDOMAIN_RE,
    SpecError,
    read_bool,
    read_enum,
    read_int,
    read_num,
    read_obj,
    read_str,
    read_str_map,
)
from spotguard.operator.staging import StagingSpec, parse_staging
from spotguard.storage.uri import parse_storage_uri

GROUP = "spotguard.dev"
VERSION = "v1alpha1"
PLURAL = "trainingjobs"
KIND = "TrainingJob"
API_VERSION = f"{GROUP}/{VERSION}"

#: Names the operator adds to every pod; a template may not use them.
SIDECAR_CONTAINER = "spotguard-sidecar"
RESTORE_CONTAINER = "spotguard-restore"
SHARED_VOLUME = "spotguard"
#: gs:// with a credentials Secret: its service account key, mounted into spotguard's containers.
GCS_KEY_VOLUME = "spotguard-gcs-key"
#: The k8s notice source with a notice relay: the sidecar's projected token for it.
NOTICE_TOKEN_VOLUME = "spotguard-notice-token"
#: ``checkpoint.memoryStaging``: the memory volume a preemption's checkpoint is written to.
EMERGENCY_VOLUME = "spotguard-emergency"
#: The writable /tmp of spotguard's containers (their root filesystem is read-only).
TMP_VOLUME = "spotguard-tmp"
RESERVED_CONTAINER_NAMES = frozenset({SIDECAR_CONTAINER, RESTORE_CONTAINER})

CHECKSUMS = ("crc32c", "sha256")
DEFAULT_MASTER_PORT = 29500
#: More nodes than any spot pool offers is a typo (and a name-length problem).
MAX_NODES = 1000
#: Kubernetes label values and DNS labels (pod hostnames, Service names) are at most 63 characters.
MAX_LABEL = 63
GPU_RESOURCE = "nvidia.com/gpu"
BEST_MODES = ("min", "max")
#: ``checkpoint.retention.keepLast`` when the spec does not say.
DEFAULT_KEEP_LAST = 3
#: Early preemption notice sources the sidecar can watch (``spotguard sidecar --notices``).
NOTICE_SOURCES = ("aws", "gce", "azure", "k8s")

_DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_SECRET_KEY_RE = re.compile(r"^[-._a-zA-Z0-9]+$")
_ENDPOINT_RE = re.compile(r"^https?://[^\s/]+(/\S*)?$")


@dataclass(frozen=True, slots=True)
class CredentialsSecret:
    """Reference to the Secret holding the object-store credentials."""

    name: str
    access_key_id_key: str = "AWS_ACCESS_KEY_ID"
    secret_access_key_key: str = "AWS_SECRET_ACCESS_KEY"
    #: Optional key with the endpoint URL (so one Secret describes a whole store).
    endpoint_key: str = "AWS_ENDPOINT_URL"
    #: gs://: the key holding a service account's JSON key (mounted as a file, never an env value).
    key_file_key: str = "key.json"


@dataclass(frozen=True, slots=True)
class CheckpointSpec:
    """Where and how often checkpoints are written."""

    storage: str
    credentials_secret: CredentialsSecret | None = None
    endpoint: str | None = None
    region: str | None = None
    every_steps: int | None = None
    every_seconds: float | None = None
    checksum: str = "crc32c"
    #: Which remote checkpoints the sidecar keeps: the one retention model, from
    #: ``checkpoint.retention`` (``keepLast``, ``keepBest``, ``bestMetric``, ``bestMode``, ``keepEvery``).
    retention: RetentionPolicy = field(default_factory=lambda: RetentionPolicy(keep_last=DEFAULT_KEEP_LAST))
    #: Give the trainer containers the storage credentials too (only the restore
    #: init container and the sidecar get them otherwise): for trainers that read
    #: or write storage themselves.
    expose_credentials_to_trainer: bool = False
    #: Resume through a restore grant where the store signs reads: the restore init container
    #: grants the trainer reads instead of restoring first (``spotguard restore --grant``), for
    #: trainers that resume through spotguard's Checkpointer of this version (off: one that does not
    #: would find no local copy).
    restore_grant: bool = False
    #: Store checkpoints as content-addressed chunks shared between checkpoints,
    #: so that each upload sends only what changed (on by default; off: the sidecar's ``--no-incremental``).
    incremental: bool = True
    #: Where checkpoints are staged in the pod; None: an ``emptyDir`` without a limit (as before).
    staging: StagingSpec | None = None
    #: Give the pod a memory volume where a preemption's checkpoint is written before it is
    #: shipped (see spotguard.checkpoint.local.staged); off: it is written to the staging volume.
    memory_staging: bool = True
    #: With the memory volume: the trainer sets aside in it, after each routine checkpoint, the memory
    #: a preemption's checkpoint of that size takes (see spotguard.checkpoint.local.reserve).
    reserve_staging: bool = False

    def job_uri(self, namespace: str, job: str) -> str:
        """The job's own checkpoint root: ``<storage>/<namespace>/<job>``."""
        return f"{self.storage.rstrip('/')}/{namespace}/{job}"


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential delay before the n-th consecutive restart."""

    initial_seconds: float
    max_seconds: float
    factor: float = 2.0

    def delay(self, n: int) -> float:
        """Seconds to wait before restart number ``n`` (1-based)."""
        if n <= 0 or self.initial_seconds <= 0:
            return 0.0
        return float(min(self.max_seconds, self.initial_seconds * self.factor ** (n - 1)))


@dataclass(frozen=True, slots=True)
class PreemptionSpec:
    """Separate budgets and backoff for preemptions and for the user's failures."""

    max_preemptions: int = 20
    backoff_limit: int = 3
    backoff: Backoff = field(default_factory=lambda: Backoff(10.0, 300.0, 2.0))
    preemption_backoff: Backoff = field(default_factory=lambda: Backoff(0.0, 60.0, 2.0))
    grace_period_seconds: int = 60
    #: Early notice sources the sidecar polls (a checkpoint before SIGTERM).
    notices: tuple[str, ...] = ()

    @property
    def watches_own_pod(self) -> bool:
        """Whether the ``k8s`` source is on: the sidecar watches its own pod (through the operator's relay)."""
        return "k8s" in self.notices


@dataclass(frozen=True, slots=True)
class SidecarSpec:
    """Overrides for the injected sidecar container."""

    image: str | None = None
    metrics_port: int = 9400
    resources: Mapping[str, Any] | None = None


#: What a failure rule does: restart without counting against ``backoffLimit``,
#: count (today's default for every failure), or fail the job at once.
RULE_ACTIONS = ("Ignore", "Count", "FailJob")
EXIT_CODE_OPERATORS = ("In", "NotIn")


@dataclass(frozen=True, slots=True)
class FailureRule:
    """One rule of ``spec.failurePolicy``: which failed attempts it matches, and what it does.

    Shaped like a Kubernetes Job's ``podFailurePolicy`` rule (``onExitCodes``
    with ``operator`` In/NotIn and an optional ``containerName``), with
    ``onReasons`` for the reason spotguard gives an attempt's end
    (``OOMKilled``, ``Error``, ``SidecarFailed``, ...). A rule with both
    matches when both do. Preemptions are never matched: they have their own budget.
    """

    action: str
    exit_codes: tuple[int, ...] = ()
    exit_operator: str = "In"
    container: str | None = None
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Placement:
    """Where pods go: what replaces the template's own nodeSelector, tolerations, affinity (None: keep it)."""

    node_selector: Mapping[str, str] | None = None
    tolerations: tuple[Mapping[str, Any], ...] | None = None
    affinity: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class FallbackSpec:
    """``spec.fallback``: a second placement (an on-demand pool) used when the first keeps failing the job.

    The job moves there after ``after_preemptions`` preemptions within
    ``window_seconds``, or when its pods could not be scheduled for
    ``after_unschedulable_seconds``; it returns after ``cooldown_seconds``.
    """

    placement: Placement
    after_preemptions: int = 3
    window_seconds: float = 3600.0
    after_unschedulable_seconds: float | None = 600.0
    cooldown_seconds: float = 3600.0


@dataclass(frozen=True, slots=True)
class AvoidNodesSpec:
    """``spec.avoidNodes``: a node on which the job ended ``after_ends`` times is avoided for ``for_seconds``."""

    after_ends: int = 2
    for_seconds: float = 3600.0


@dataclass(frozen=True, slots=True)
class PodTemplate:
    """The user's pod template; passed through untouched apart from the injection."""

    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    spec: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class TrainingJobSpec:
    """A parsed, validated ``TrainingJob.spec``."""

    template: PodTemplate
    checkpoint: CheckpointSpec
    preemption: PreemptionSpec = field(default_factory=PreemptionSpec)
    sidecar: SidecarSpec = field(default_factory=SidecarSpec)
    suspend: bool = False
    #: Nodes (one pod each) of every attempt; 1 is a single pod as before.
    nodes: int = 1
    #: Training processes per node (torchrun's ``--nproc-per-node``).
    nproc_per_node: int = 1
    #: Port of the rendezvous store on node rank 0 (torchrun's ``--master-port``).
    master_port: int = DEFAULT_MASTER_PORT
    #: ``spec.masterPort`` was given (with ``hostNetwork`` the operator picks one otherwise).
    master_port_set: bool = False
    #: ``spec.sidecar.metricsPort`` was given.
    metrics_port_set: bool = False
    #: ``spec.failurePolicy.rules``: the first rule that matches a failed attempt decides.
    failure_rules: tuple[FailureRule, ...] = ()
    #: The job fails (its pods stopped after a checkpoint) this long after it started.
    active_deadline_seconds: int | None = None
    #: The TrainingJob object is deleted this long after it finished (its checkpoints are kept).
    ttl_seconds_after_finished: int | None = None
    fallback: FallbackSpec | None = None
    avoid_nodes: AvoidNodesSpec | None = None

    @property
    def distributed(self) -> bool:
        """Whether the pods get torchrun's environment (several nodes or processes)."""
        return self.nodes > 1 or self.nproc_per_node > 1

    @property
    def world_size(self) -> int:
        """Training processes of one attempt, all nodes together."""
        return self.nodes * self.nproc_per_node

    @property
    def host_network(self) -> bool:
        """Whether the pods share their node's network (``hostNetwork: true``)."""
        return bool(self.template.spec.get("hostNetwork"))


# --- parsers ------------------------------------------------------------------


def parse_storage(value: str, path: str) -> str:
    """Check a storage root URI (``s3://bucket[/prefix]``, ``gs://bucket[/prefix]`` or ``file:///path``):
    storage's own grammar (:mod:`spotguard.storage.uri`), which the CRD's pattern repeats."""
    try:
        parse_storage_uri(value)
    except ValueError as exc:
        raise SpecError(
            path, f"must be s3://<bucket>[/prefix], gs://<bucket>[/prefix] or file:///<path>: {exc}"
        ) from None
    return value


def parse_credentials(raw: Any, path: str) -> CredentialsSecret | None:
    """Parse ``credentialsSecret``: a Secret name or ``{name, ...keys}``."""
    if raw is None:
        return None
    if isinstance(raw, str):
        raw = {"name": raw}
    obj = read_obj(raw, path)
    name = read_str(obj, "name", path, required=True)
    assert name is not None
    if not DNS_SUBDOMAIN_RE.match(name):
        raise SpecError(f"{path}.name", f"must be a Secret name, not {name!r}")
    keys: dict[str, str] = {}
    for key, attr in (
        ("accessKeyIdKey", "access_key_id_key"),
        ("secretAccessKeyKey", "secret_access_key_key"),
        ("endpointKey", "endpoint_key"),
        ("keyFileKey", "key_file_key"),
    ):
        value = read_str(obj, key, path)
        if value is not None:
            if not _SECRET_KEY_RE.match(value):
                raise SpecError(f"{path}.{key}", f"must be a Secret data key, not {value!r}")
            keys[attr] = value
    return CredentialsSecret(name=name, **keys)


def parse_retention(raw: Any, path: str) -> RetentionPolicy:
    """Parse ``checkpoint.retention``: the spec's names (``bestMetric``, ``bestMode``; 0 turns
    ``keepBest``/``keepEvery`` off) mapped to :class:`~spotguard.checkpoint.store.retention.RetentionPolicy`."""
    obj = read_obj(raw, path)
    keep_best = read_int(obj, "keepBest", path, 0) or 0
    metric = read_str(obj, "bestMetric", path)
    if keep_best > 0 and not metric:
        raise SpecError(f"{path}.bestMetric", "is required when keepBest > 0")
    return RetentionPolicy(
        keep_last=read_int(obj, "keepLast", path, DEFAULT_KEEP_LAST, minimum=1) or 1,
        keep_best=keep_best or None,
        metric=metric,
        mode=read_enum(obj, "bestMode", path, BEST_MODES, "min"),
        keep_every=read_int(obj, "keepEvery", path, 0) or None,
    )


def parse_checkpoint(raw: Any, path: str = "spec.checkpoint") -> CheckpointSpec:
    """Parse ``spec.checkpoint``."""
    obj = read_obj(raw, path, required=True)
    storage = parse_storage(read_str(obj, "storage", path, required=True) or "", f"{path}.storage")
    endpoint = read_str(obj, "endpoint", path)
    if endpoint is not None and not _ENDPOINT_RE.match(endpoint):
        raise SpecError(f"{path}.endpoint", f"must be an http(s):// URL, not {endpoint!r}")
    every_steps = read_int(obj, "everySteps", path, None, minimum=1)
    every_seconds = read_num(obj, "everySeconds", path, None, minimum=1.0)
    return CheckpointSpec(
        storage=storage,
        credentials_secret=parse_credentials(obj.get("credentialsSecret"), f"{path}.credentialsSecret"),
        endpoint=endpoint,
        region=read_str(obj, "region", path),
        every_steps=every_steps,
        every_seconds=every_seconds,
        checksum=read_enum(obj, "checksum", path, CHECKSUMS, "crc32c"),
        retention=parse_retention(obj.get("retention"), f"{path}.retention"),
        expose_credentials_to_trainer=read_bool(obj, "exposeCredentialsToTrainer", path, False),
        restore_grant=read_bool(obj, "restoreGrant", path, False),
        incremental=read_bool(obj, "incremental", path, True),
        staging=parse_staging(obj.get("staging"), f"{path}.staging"),
        memory_staging=read_bool(obj, "memoryStaging", path, True),
        reserve_staging=read_bool(obj, "reserveStaging", path, False),
    )


def _parse_backoff(raw: Any, path: str, default: Backoff) -> Backoff:
    obj = read_obj(raw, path)
    initial = read_num(obj, "initialSeconds", path, default.initial_seconds)
    maximum = read_num(obj, "maxSeconds", path, default.max_seconds)
    factor = read_num(obj, "factor", path, default.factor, minimum=1.0)
    assert initial is not None and maximum is not None and factor is not None
    if maximum < initial:
        raise SpecError(f"{path}.maxSeconds", f"must be >= initialSeconds ({initial:g})")
    return Backoff(initial, maximum, factor)


def parse_notices(raw: Any, path: str) -> tuple[str, ...]:
    """Parse ``preemption.notices``: a list of known source names, each at most once."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise SpecError(path, f"must be a list of {', '.join(NOTICE_SOURCES)}, not {type(raw).__name__}")
    seen: list[str] = []
    for i, name in enumerate(raw):
        if not isinstance(name, str) or name not in NOTICE_SOURCES:
            raise SpecError(f"{path}[{i}]", f"must be one of {', '.join(NOTICE_SOURCES)}, not {name!r}")
        if name in seen:
            raise SpecError(f"{path}[{i}]", f"{name!r} is listed twice")
        seen.append(name)
    return tuple(seen)


def parse_preemption(raw: Any, path: str = "spec.preemption") -> PreemptionSpec:
    """Parse ``spec.preemption``."""
    obj = read_obj(raw, path)
    defaults = PreemptionSpec()
    grace = read_int(obj, "gracePeriodSeconds", path, defaults.grace_period_seconds, minimum=1)
    return PreemptionSpec(
        max_preemptions=read_int(obj, "maxPreemptions", path, defaults.max_preemptions) or 0,
        backoff_limit=read_int(obj, "backoffLimit", path, defaults.backoff_limit) or 0,
        backoff=_parse_backoff(obj.get("backoff"), f"{path}.backoff", defaults.backoff),
        preemption_backoff=_parse_backoff(
            obj.get("preemptionBackoff"), f"{path}.preemptionBackoff", defaults.preemption_backoff
        ),
        grace_period_seconds=grace or defaults.grace_period_seconds,
        notices=parse_notices(obj.get("notices"), f"{path}.notices"),
    )


def parse_sidecar(raw: Any, path: str = "spec.sidecar") -> SidecarSpec:
    """Parse ``spec.sidecar``."""
    obj = read_obj(raw, path)
    port = read_int(obj, "metricsPort", path, 9400, minimum=0)
    assert port is not None
    if port > 65535:
        raise SpecError(f"{path}.metricsPort", f"must be <= 65535, not {port}")
    resources = obj.get("resources")
    if resources is not None:
        resources = copy.deepcopy(dict(read_obj(resources, f"{path}.resources")))
    return SidecarSpec(image=read_str(obj, "image", path), metrics_port=port, resources=resources)


def parse_template(raw: Any, path: str = "spec.template") -> PodTemplate:
    """Parse ``spec.template``: a pod template whose containers are the trainer."""
    obj = read_obj(raw, path, required=True)
    meta = read_obj(obj.get("metadata"), f"{path}.metadata")
    pod_spec = read_obj(obj.get("spec"), f"{path}.spec", required=True)
    spath = f"{path}.spec"
    containers = pod_spec.get("containers")
    if not isinstance(containers, list) or not containers:
        raise SpecError(f"{spath}.containers", "must list at least one container")
    seen: set[str] = set()
    for i, c in enumerate(containers):
        cpath = f"{spath}.containers[{i}]"
        if not isinstance(c, Mapping):
            raise SpecError(cpath, "must be an object")
        name = read_str(c, "name", cpath, required=True)
        assert name is not None
        if not _DNS_LABEL_RE.match(name):
            raise SpecError(f"{cpath}.name", f"must be a DNS label, not {name!r}")
        if name in RESERVED_CONTAINER_NAMES or name in seen:
            raise SpecError(f"{cpath}.name", f"{name!r} is reserved or used twice")
        seen.add(name)
    for i, c in enumerate(pod_spec.get("initContainers") or []):
        if isinstance(c, Mapping) and c.get("name") in RESERVED_CONTAINER_NAMES:
            raise SpecError(f"{spath}.initContainers[{i}].name", f"{c.get('name')!r} is reserved")
    for i, v in enumerate(pod_spec.get("volumes") or []):
        if isinstance(v, Mapping) and v.get("name") in (
            SHARED_VOLUME,
            GCS_KEY_VOLUME,
            NOTICE_TOKEN_VOLUME,
            EMERGENCY_VOLUME,
            TMP_VOLUME,
        ):
            raise SpecError(f"{spath}.volumes[{i}].name", f"{v.get('name')!r} is reserved")
    policy = pod_spec.get("restartPolicy")
    if policy not in (None, "Never"):
        raise SpecError(
            f"{spath}.restartPolicy",
            f"must be Never or unset (spotguard restarts attempts itself), not {policy!r}",
        )
    return PodTemplate(
        labels=read_str_map(meta.get("labels"), f"{path}.metadata.labels"),
        annotations=read_str_map(meta.get("annotations"), f"{path}.metadata.annotations"),
        spec=copy.deepcopy(dict(pod_spec)),
    )


def gpu_limit(template: PodTemplate) -> int | None:
    """The ``nvidia.com/gpu`` limit of the trainer (the template's first container), if it has one."""
    containers = template.spec.get("containers") or []
    first = containers[0] if containers and isinstance(containers[0], Mapping) else {}
    limits = (first.get("resources") or {}).get("limits") or {}
    value = limits.get(GPU_RESOURCE) if isinstance(limits, Mapping) else None
    try:
        n = int(str(value)) if value is not None else None
    except ValueError:
        return None
    return n if n is not None and n > 0 else None


def _int_list(raw: Any, path: str) -> tuple[int, ...]:
    if not isinstance(raw, list) or not raw:
        raise SpecError(path, "must be a non-empty list of integers")
    out: list[int] = []
    for i, v in enumerate(raw):
        if isinstance(v, bool) or not isinstance(v, int):
            raise SpecError(f"{path}[{i}]", f"must be an integer, not {v!r}")
        out.append(v)
    return tuple(out)


def parse_failure_policy(raw: Any, path: str = "spec.failurePolicy") -> tuple[FailureRule, ...]:
    """Parse ``spec.failurePolicy``: ``{rules: [{action, onExitCodes?, onReasons?}]}``."""
    obj = read_obj(raw, path)
    rules_raw = obj.get("rules")
    if rules_raw is None:
        return ()
    if not isinstance(rules_raw, list):
        raise SpecError(f"{path}.rules", "must be a list")
    rules: list[FailureRule] = []
    for i, r in enumerate(rules_raw):
        rpath = f"{path}.rules[{i}]"
        rule = read_obj(r, rpath, required=True)
        action = read_str(rule, "action", rpath, required=True)
        if action not in RULE_ACTIONS:
            raise SpecError(f"{rpath}.action", f"must be one of {', '.join(RULE_ACTIONS)}, not {action!r}")
        codes: tuple[int, ...] = ()
        operator, container = "In", None
        if rule.get("onExitCodes") is not None:
            epath = f"{rpath}.onExitCodes"
            exit_obj = read_obj(rule.get("onExitCodes"), epath)
            operator = read_enum(exit_obj, "operator", epath, EXIT_CODE_OPERATORS, "In")
            codes = _int_list(exit_obj.get("values"), f"{epath}.values")
            container = read_str(exit_obj, "containerName", epath)
        reasons: tuple[str, ...] = ()
        if rule.get("onReasons") is not None:
            rs = rule.get("onReasons")
            if not isinstance(rs, list) or not rs or not all(isinstance(x, str) and x for x in rs):
                raise SpecError(f"{rpath}.onReasons", "must be a non-empty list of reasons (e.g. OOMKilled)")
            reasons = tuple(rs)
        if not codes and not reasons:
            raise SpecError(rpath, "needs onExitCodes or onReasons (a rule that matches every failure is a typo)")
        rules.append(FailureRule(action, codes, operator, container, reasons))
    return tuple(rules)


def parse_placement(raw: Mapping[str, Any], path: str) -> Placement:
    """The placement fields of ``spec.fallback`` (each replaces the template's own when given)."""
    selector = None
    if raw.get("nodeSelector") is not None:
        selector = read_str_map(raw.get("nodeSelector"), f"{path}.nodeSelector")
    tolerations = raw.get("tolerations")
    if tolerations is not None:
        if not isinstance(tolerations, list) or not all(isinstance(t, Mapping) for t in tolerations):
            raise SpecError(f"{path}.tolerations", "must be a list of tolerations")
        tolerations = tuple(copy.deepcopy(dict(t)) for t in tolerations)
    affinity = raw.get("affinity")
    if affinity is not None:
        affinity = copy.deepcopy(dict(read_obj(affinity, f"{path}.affinity")))
    if selector is None and tolerations is None and affinity is None:
        raise SpecError(path, "needs nodeSelector, tolerations or affinity: where the fallback pods go")
    return Placement(selector, tolerations, affinity)


def parse_fallback(raw: Any, path: str = "spec.fallback") -> FallbackSpec | None:
    """Parse ``spec.fallback`` (None when absent). ``afterUnschedulableSeconds: 0`` turns that trigger off."""
    if raw is None:
        return None
    obj = read_obj(raw, path)
    d = FallbackSpec(Placement())
    unschedulable = read_num(obj, "afterUnschedulableSeconds", path, d.after_unschedulable_seconds)
    after = read_int(obj, "afterPreemptions", path, d.after_preemptions, minimum=1)
    window = read_num(obj, "preemptionWindowSeconds", path, d.window_seconds, minimum=1.0)
    cooldown = read_num(obj, "cooldownSeconds", path, d.cooldown_seconds, minimum=1.0)
    assert after is not None and window is not None and cooldown is not None
    return FallbackSpec(
        placement=parse_placement(obj, path),
        after_preemptions=after,
        window_seconds=window,
        after_unschedulable_seconds=unschedulable or None,
        cooldown_seconds=cooldown,
    )


def parse_avoid_nodes(raw: Any, path: str = "spec.avoidNodes") -> AvoidNodesSpec | None:
    """Parse ``spec.avoidNodes`` (None when absent: no node is avoided)."""
    if raw is None:
        return None
    obj = read_obj(raw, path)
    defaults = AvoidNodesSpec()
    return AvoidNodesSpec(
        after_ends=read_int(obj, "afterEnds", path, defaults.after_ends, minimum=1) or defaults.after_ends,
        for_seconds=read_num(obj, "forSeconds", path, defaults.for_seconds, minimum=1.0) or defaults.for_seconds,
    )


def parse(spec: Any) -> TrainingJobSpec:
    """Parse and validate a ``TrainingJob.spec``; raises ``SpecError`` naming the field."""
    obj = read_obj(spec, "spec", required=True)
    template = parse_template(obj.get("template"))
    nodes = read_int(obj, "nodes", "spec", 1, minimum=1)
    assert nodes is not None
    if nodes > MAX_NODES:
        raise SpecError("spec.nodes", f"must be at most {MAX_NODES}, not {nodes}")
    nproc = read_int(obj, "nprocPerNode", "spec", gpu_limit(template) or 1, minimum=1)
    assert nproc is not None
    if nproc > 1024:
        raise SpecError("spec.nprocPerNode", f"must be at most 1024, not {nproc}")
    master_port = read_int(obj, "masterPort", "spec", DEFAULT_MASTER_PORT, minimum=1)
    assert master_port is not None
    if master_port > 65535:
        raise SpecError("spec.masterPort", f"must be <= 65535, not {master_port}")
    sidecar = parse_sidecar(obj.get("sidecar"))
    if obj.get("masterPort") is not None and master_port == sidecar.metrics_port:
        raise SpecError("spec.masterPort", f"{master_port} is also spec.sidecar.metricsPort: use two ports")
    sidecar_raw = obj.get("sidecar")
    checkpoint = parse_checkpoint(obj.get("checkpoint"))
    preemption = parse_preemption(obj.get("preemption"))
    deadline = read_int(obj, "activeDeadlineSeconds", "spec", None, minimum=1)
    ttl = read_int(obj, "ttlSecondsAfterFinished", "spec", None, minimum=0)
    return TrainingJobSpec(
        template=template,
        checkpoint=checkpoint,
        preemption=preemption,
        sidecar=sidecar,
        suspend=read_bool(obj, "suspend", "spec", False),
        nodes=nodes,
        nproc_per_node=nproc,
        master_port=master_port,
        master_port_set=obj.get("masterPort") is not None,
        metrics_port_set=isinstance(sidecar_raw, Mapping) and sidecar_raw.get("metricsPort") is not None,
        failure_rules=parse_failure_policy(obj.get("failurePolicy")),
        active_deadline_seconds=deadline,
        ttl_seconds_after_finished=ttl,
        fallback=parse_fallback(obj.get("fallback")),
        avoid_nodes=parse_avoid_nodes(obj.get("avoidNodes")),
    )


_DNS_1035_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def check_name(name: str, spec: TrainingJobSpec) -> None:
    """Refuse a job name that cannot make the pods' names, labels and hostnames; the limit is named.

    The name is the value of the ``spotguard.dev/job`` label on every pod (at
    most 63 characters). A job of several nodes also names its headless Service
    (a DNS-1035 label: a lowercase letter first, no dots) and the pods'
    hostnames ``<name>-<node rank>`` (DNS labels of at most 63 characters).
    """
    if len(name) > MAX_LABEL:
        raise SpecError(
            "metadata.name",
            f"is {len(name)} characters; at most {MAX_LABEL} (it is the value of the spotguard.dev/job label"
            " on every pod): choose a shorter name",
        )
    if spec.nodes > 1:
        longest = MAX_LABEL - len(f"-{spec.nodes - 1}")
        if len(name) > longest:
            raise SpecError(
                "metadata.name",
                f"is {len(name)} characters; with spec.nodes {spec.nodes} at most {longest} (the pods' hostnames"
                f" <name>-<node rank> are DNS labels of at most {MAX_LABEL}): choose a shorter name",
            )
        if not _DNS_1035_RE.match(name):
            raise SpecError(
                "metadata.name",
                f"{name!r} cannot name the job's headless Service (spec.nodes > 1): use lowercase letters, digits"
                " and '-', starting with a letter, without dots",
            )
