"""The ``SPOTGUARD_*`` environment variables, each named once: its type, default and meaning.

The operator's pod builder and ``spotguard run`` write these variables; the
Checkpointer, the sidecar, the restore init container and the operator read
them. Each used to spell and parse them its own way, and the readers
disagreed (a bad number ignored here and an error there, ``on`` a boolean
for one variable and not for another). Here every variable is one
:class:`Var` in one table, with one parser per type:

- :func:`from_env` reads a variable and parses it; an unset or blank
  variable is its default. A bad value raises one ``ValueError`` naming the
  variable, the value and what it must be;
- :func:`to_env` renders a value as the writers put it in a pod spec or an
  environment, so that :func:`from_env` reads it back;
- :func:`add_option` gives a command line a variable's option: its flag,
  type, choices and help come from the table, its default from the
  environment (:func:`cli_default`): the text stays unparsed until the
  subcommand that uses it runs, so a bad variable only stops the command
  that reads it (argparse converts numbers; booleans go through
  :func:`option_or_env`). The sidecar, ``spotguard run``, the operator and
  the Checkpointer's own flags (:mod:`spotguard.trainer.config`) are made so.

Callers name a variable by its :class:`Var` (``env.STORAGE_URI.name`` where
the string is needed). Part of :mod:`spotguard.contract`, the floor below the
trainer and the uploader; the control files next door
(:mod:`~spotguard.contract.control`) read ``SPOTGUARD_CONTROL_DIR`` from here.
Standard library only.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

T = TypeVar("T", str, int, float, bool)
D = TypeVar("D")

#: Every variable's name starts so.
PREFIX = "SPOTGUARD_"

#: The one boolean vocabulary (case-insensitive); anything else is an error.
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")

#: What a number may be: anything, at least 0, or more than 0.
Bound = Literal["any", "non-negative", "positive"]


@dataclass(frozen=True)
class Var(Generic[T, D]):
    """One environment variable of the contract.

    ``type`` is what :func:`from_env` returns (str, int, float or bool);
    ``default`` what an unset or blank variable means (None: the reader
    decides, e.g. a flag's own default, or "not configured"); ``meaning`` one
    line for people (also the option's help); ``bound`` the range a number
    must be in; ``flag`` the command-line option where it is not the name's
    (``SPOTGUARD_KEEP_LAST``: ``--keep-last``); ``choices`` the only values a
    word may take.
    """

    name: str
    type: type[T]
    default: D
    meaning: str
    bound: Bound = "any"
    flag: str = ""
    choices: tuple[str, ...] = ()

    @property
    def option(self) -> str:
        """The command-line option that sets this variable (``--keep-last``)."""
        return self.flag or "--" + self.name.removeprefix(PREFIX).lower().replace("_", "-")


def _var(name: str, type_: type[T], default: D, meaning: str, bound: Bound = "any", **cli: Any) -> Var[T, D]:
    return Var(PREFIX + name, type_, default, meaning, bound, **cli)


# -- the table ------------------------------------------------------------------
# Where a pod gets them: the operator (spotguard/operator/podbuilder.py) writes
# the trainer's and the sidecar's; ``spotguard run`` writes the trainer's.

# The Checkpointer (trainer side), also read by the restore init container and the sidecar.
CHECKPOINT_DIR = _var(
    "CHECKPOINT_DIR",
    str,
    None,
    "local checkpoint directory shared by trainer and uploader (unset: the reader's default)",
)
CONTROL_DIR = _var("CONTROL_DIR", str, None, "control channel directory (unset: <checkpoint dir>/.control)")
EMERGENCY_STAGING = _var(
    "EMERGENCY_STAGING",
    str,
    None,
    "a memory file system shared with the uploader where a preemption's checkpoint is written (unset: none)",
)
STAGING_RESERVE = _var(
    "STAGING_RESERVE",
    bool,
    False,
    "after each routine save, set aside in the emergency staging the memory a preemption's save takes",
)
STAGING_ARENA = _var(
    "STAGING_ARENA",
    bool,
    True,
    "after a routine save, move the host buffers of CPU tensors into the emergency staging, laid out as the"
    " checkpoint's files, so that a preemption's save links them instead of writing them",
)
FINAL_VERIFY_SECONDS = _var(
    "FINAL_VERIFY_SECONDS",
    float,
    0.0,
    "a trainer that finished waits on its way out, at most this long, until the uploader verified its last"
    " checkpoint (0: no wait; set for native sidecars, which are stopped once the trainer exits)",
    "non-negative",
)
STORAGE_URI = _var(
    "STORAGE_URI", str, None, "the job's checkpoint root, s3://..., gs://... or file://...", flag="--storage"
)
JOB = _var("JOB", str, None, "job name for manifests, metrics and logs")
ATTEMPT = _var("ATTEMPT", int, None, "the restart attempt this pod or command belongs to", "non-negative")
CHECKSUM = _var("CHECKSUM", str, None, "checksum algorithm of new checkpoints (unset: the default algorithm)")
SAVE_EVERY_STEPS = _var(
    "SAVE_EVERY_STEPS", int, None, "checkpoint every N steps (unset or 0: no step interval)", "non-negative"
)
SAVE_EVERY_SECONDS = _var(
    "SAVE_EVERY_SECONDS",
    float,
    None,
    "checkpoint every this many seconds (unset or 0: no time interval)",
    "non-negative",
)

# Retention (the Checkpointer's local pruning, the sidecar's and spotguard run's storage retention).
KEEP_LAST = _var("KEEP_LAST", int, None, "retention: keep the N newest checkpoints", "non-negative")
KEEP_BEST = _var("KEEP_BEST", int, None, "retention: keep the M best by SPOTGUARD_BEST_METRIC", "non-negative")
BEST_METRIC = _var("BEST_METRIC", str, None, "retention: the metric saved with each checkpoint that ranks them")
BEST_MODE = _var(
    "BEST_MODE",
    str,
    "min",
    "retention: min or max, whether lower or higher SPOTGUARD_BEST_METRIC is better",
    choices=("min", "max"),
)
KEEP_EVERY = _var(
    "KEEP_EVERY", int, None, "retention: keep every checkpoint whose step is a multiple of K", "non-negative"
)
KEEP_LOCAL = _var(
    "KEEP_LOCAL", int, 1, "local checkpoints kept after a newer one is verified in storage", "non-negative"
)
#: The rules of a storage retention policy, in the order the command lines show them.
RETENTION = (KEEP_LAST, KEEP_BEST, BEST_METRIC, BEST_MODE, KEEP_EVERY)

# The sidecar and spotguard run (uploader side).
SIDECAR_MODE = _var(
    "SIDECAR_MODE",
    str,
    "classic",
    "classic: exit once the trainer has exited and everything is shipped; native (Kubernetes native sidecar):"
    " run until SIGTERM",
    flag="--mode",
    choices=("classic", "native"),
)
GRACE_SECONDS = _var("GRACE_SECONDS", float, 30.0, "seconds between SIGTERM and the kill", "non-negative")
SAFETY_MARGIN_SECONDS = _var(
    "SAFETY_MARGIN_SECONDS",
    float,
    5.0,
    "seconds kept free at the end of the grace period",
    "non-negative",
    flag="--safety-margin",
)
FINISH_SECONDS = _var(
    "FINISH_SECONDS",
    float,
    600.0,
    "after the trainer exits on its own, how long shipping its last checkpoint may go without progress"
    " (its own upload, or other nodes' parts and bytes appearing in storage) before it is given up",
    "non-negative",
)
PROACTIVE_INTERVAL = _var(
    "PROACTIVE_INTERVAL", float, 0.0, "when at risk, request a checkpoint this often (0: never)", "non-negative"
)
METRICS_PORT = _var("METRICS_PORT", int, 9400, "the sidecar's Prometheus metrics port (0: off)", "non-negative")
METRICS_ADDR = _var("METRICS_ADDR", str, "0.0.0.0", "address the sidecar serves metrics on")
TERMINATION_LOG = _var(
    "TERMINATION_LOG",
    str,
    "/dev/termination-log",
    "where the sidecar writes its exit report (the default only where it exists)",
)
PREEMPTED_EXIT_CODE = _var(
    "PREEMPTED_EXIT_CODE",
    int,
    0,
    "the sidecar's exit status after a preemption it handled (the webhook sets 143 in the pods it injects, so that a"
    " preempted pod fails and its Job or workload runs it again instead of counting it done)",
    "non-negative",
)
INCREMENTAL = _var(
    "INCREMENTAL", bool, True, "upload checkpoints as shared content-addressed chunks (false: whole files)"
)
TRACK_WRITES = _var(
    "TRACK_WRITES",
    bool,
    True,
    "tell unchanged CPU tensors by the kernel's write tracking, without reading them (false: compare every tensor)",
)
RUN_ID = _var("RUN_ID", str, None, "marks the processes of one spotguard run, so that a later start can kill them")
PASS_CREDENTIALS = _var(
    "PASS_CREDENTIALS",
    bool,
    False,
    "spotguard run: hand the command the cloud credential variables and SPOTGUARD_STORAGE_URI (default: strip them)",
)
RESTORE_GRANT = _var(
    "RESTORE_GRANT",
    bool,
    True,
    "spotguard run: where the store signs reads, the command streams the checkpoint it resumes from into its "
    "tensors (a restore grant) and the local copy follows; off: the local copy before the command starts, for "
    "a command that resumes other than through spotguard (a TrainingJob: checkpoint.restoreGrant, off by default)",
)

# Early preemption notices (the sidecar and spotguard run).
NOTICES = _var("NOTICES", str, "", "notice sources to poll, comma-separated from aws,gce,azure,k8s")
NOTICE_INTERVAL = _var("NOTICE_INTERVAL", float, 2.0, "seconds between notice polls", "non-negative")
NOTICE_STOPS_TRAINING = _var(
    "NOTICE_STOPS_TRAINING",
    bool,
    False,
    "stop training after a notice's checkpoint instead of continuing until SIGTERM",
)
NOTICE_URL = _var("NOTICE_URL", str, None, "the operator's notice relay the k8s source asks (set by the operator)")
NOTICE_TOKEN_FILE = _var(
    "NOTICE_TOKEN_FILE", str, None, "the pod's projected token the relay is shown (unset: where the operator mounts it)"
)
AWS_IMDS_ENDPOINT = _var("AWS_IMDS_ENDPOINT", str, None, "the AWS instance metadata endpoint (unset: AWS's)")
GCE_METADATA_ENDPOINT = _var("GCE_METADATA_ENDPOINT", str, None, "the GCE metadata endpoint (unset: Google's)")
AZURE_METADATA_ENDPOINT = _var(
    "AZURE_METADATA_ENDPOINT", str, None, "the Azure scheduled-events endpoint (unset: Azure's)"
)

# Storage garbage collection (everyone who uploads or collects).
GC_LEASE_SECONDS = _var(
    "GC_LEASE_SECONDS", float, 60.0, "how long an upload intent protects its chunks from collection", "positive"
)

# The operator.
IMAGE = _var("IMAGE", str, None, "image of the restore and sidecar containers (unset: the release's image)")
RESYNC_SECONDS = _var("RESYNC_SECONDS", float, 30.0, "look at every job at least this often", "non-negative")
CHECKPOINT_POLL_SECONDS = _var(
    "CHECKPOINT_POLL_SECONDS", float, 30.0, "how often to read each job's newest verified checkpoint", "non-negative"
)
CHECKPOINT_FULL_READ_SECONDS = _var(
    "CHECKPOINT_FULL_READ_SECONDS",
    float,
    1800.0,
    "read each job's checkpoints in full at least this often",
    "non-negative",
)
READ_CHECKPOINTS = _var(
    "READ_CHECKPOINTS", bool, True, "read each job's storage (with its credentials Secret) for its status"
)
ALLOWED_ENDPOINTS = _var(
    "ALLOWED_ENDPOINTS",
    str,
    "",
    "storage endpoints (HOST[:PORT] patterns, comma-separated) the operator may read a job's checkpoints from,"
    " besides the cloud's own (empty: the cloud's own only)",
)
CHECKPOINT_READ_TIMEOUT_SECONDS = _var(
    "CHECKPOINT_READ_TIMEOUT_SECONDS",
    float,
    60.0,
    "how long one read of a job's checkpoints may take before the job is told its store is too slow",
    "positive",
)
API_TIMEOUT_SECONDS = _var(
    "API_TIMEOUT_SECONDS",
    float,
    30.0,
    "how long the operator waits on the apiserver (to connect, and for each part of an answer) before the"
    " request fails and is retried",
    "positive",
)
CHECKPOINT_MAX_OBJECT_BYTES = _var(
    "CHECKPOINT_MAX_OBJECT_BYTES",
    int,
    16 << 20,
    "the largest latest pointer or manifest the operator reads from a job's store",
    "positive",
)
HOST_PORT_RANGE = _var("HOST_PORT_RANGE", str, "20000-29999", "host ports for jobs with hostNetwork, FIRST-LAST")
STAGING_HOST_PATH_PREFIX = _var(
    "STAGING_HOST_PATH_PREFIX",
    str,
    None,
    "the nodes' directory a job's hostPath staging must lie under (unset: hostPath staging is refused)",
)
STAGING_POD_DIR = _var(
    "STAGING_POD_DIR",
    str,
    None,
    "hostPath staging: the pod's own directory of its node, which the sidecar removes once the trainer is gone",
)

# The test environment's run marker: processes carrying it are the run's leftovers; the demo passes it on.
TESTENV_RUN = _var("TESTENV_RUN", str, None, "the test environment's run marker (passed on by the demo)")

#: Every variable, by name.
REGISTRY: dict[str, Var[Any, Any]] = {v.name: v for v in list(globals().values()) if isinstance(v, Var)}


# -- parsing and rendering ------------------------------------------------------------


def _expected(var: Var[Any, Any]) -> str:
    if var.type is bool:
        return f"{'/'.join(TRUE_WORDS)} or {'/'.join(FALSE_WORDS)}"
    return "an integer" if var.type is int else "a number"


def parse(var: Var[T, D], text: str | None) -> T | D:
    """Pure: ``text`` (a variable's value) as ``var``'s type; None or blank is the default.

    Raises ValueError naming the variable, the value and what it must be.
    """
    if text is None or not text.strip():
        return var.default
    raw = text.strip()
    value: Any
    if var.type is str:
        value = text
        return value  # type: ignore[no-any-return]
    if var.type is bool:
        word = raw.lower()
        if word not in TRUE_WORDS + FALSE_WORDS:
            raise ValueError(f"{var.name} must be {_expected(var)}, not {text!r}")
        value = word in TRUE_WORDS
        return value  # type: ignore[no-any-return]
    try:
        value = var.type(raw)
    except ValueError:
        raise ValueError(f"{var.name} must be {_expected(var)}, not {text!r}") from None
    if var.type is float and math.isnan(value):
        raise ValueError(f"{var.name} must be {_expected(var)}, not {text!r}")
    if var.bound == "non-negative" and value < 0:
        raise ValueError(f"{var.name} must not be negative, not {text!r}")
    if var.bound == "positive" and value <= 0:
        raise ValueError(f"{var.name} must be more than 0, not {text!r}")
    return value  # type: ignore[no-any-return]


def from_env(var: Var[T, D], environ: Mapping[str, str] | None = None) -> T | D:
    """``var`` read from ``environ`` (default: this process's environment) and parsed (:func:`parse`)."""
    env = os.environ if environ is None else environ
    return parse(var, env.get(var.name))


def to_env(var: Var[T, Any], value: T) -> str:
    """Pure: ``value`` as the text a writer puts in ``var`` (what :func:`from_env` reads back).

    Booleans are ``true``/``false``; whole floats have no fraction (``45``,
    not ``45.0``). Raises TypeError for a value of another type.
    """
    if var.type is bool and isinstance(value, bool):
        return "true" if value else "false"
    if var.type is str and isinstance(value, str):
        return value
    if var.type is int and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if var.type is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
        return str(int(number)) if number.is_integer() and abs(number) < 1e15 else repr(number)
    raise TypeError(f"{var.name} takes a {var.type.__name__}, not {value!r}")


def cli_default(var: Var[Any, Any], environ: Mapping[str, str] | None = None) -> str | None:
    """A command-line option's default: the variable's text when set, else its default as text, else None.

    Unparsed on purpose: argparse converts a string default only for the
    subcommand being run, so a bad variable stops that command alone, with
    argparse's error naming the option.
    """
    env = os.environ if environ is None else environ
    text = env.get(var.name)
    if text is not None and text.strip():
        return text
    return None if var.default is None else to_env(var, var.default)


def option_or_env(var: Var[bool, Any], value: bool | str | None) -> bool:
    """A boolean option whose default is :func:`cli_default`'s text: the option when given, else the variable.

    Raises ValueError (naming the variable) for text that is no boolean.
    """
    if isinstance(value, bool):
        return value
    parsed = parse(var, value)
    return bool(parsed)


def _env_words(var: Var[Any, Any], shown: object) -> str:
    """Pure: how an option's help names its variable and default (the table's, else ``shown``)."""
    if var.type is bool and isinstance(var.default, bool):
        shown = "on" if var.default else "off"
    elif var.default is not None and var.default != "":
        shown = to_env(var, var.default)
    return f"env {var.name}" if shown is None or shown == "" else f"env {var.name}, default {shown}"


def add_option(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    var: Var[Any, Any],
    *names: str,
    help: str | None = None,
    fallback: object = None,
    shown: str | None = None,
    environ: Mapping[str, str] | None = None,
    **extra: Any,
) -> None:
    """Add ``var``'s option to ``parser`` (a parser or an argument group), all of it from the table.

    The flag is :attr:`Var.option`, after ``names`` where a command calls it
    otherwise too (the first names the parsed value); a number is converted by argparse
    (``type``), a word checked against :attr:`Var.choices`, a boolean is
    ``--x``/``--no-x``. The default is :func:`cli_default`'s text, else
    ``fallback`` (the reader's own default where the table has none); the
    help is ``help`` (where a command says more) or the variable's meaning,
    followed by the variable and the default (``shown``: how to name a
    default the command works out later, e.g. ``WORKDIR/store``). ``extra`` goes to
    ``add_argument`` as is (``dest``, ``metavar``, a ``type`` such as Path).
    """
    text = cli_default(var, environ)
    options: dict[str, Any] = {"default": fallback if text is None else text}
    if var.type is bool:
        options["action"] = argparse.BooleanOptionalAction
    elif var.type is not str:
        options["type"] = var.type
    if var.choices:
        options["choices"] = var.choices
    said = (help or var.meaning).replace("%", "%%")
    options["help"] = f"{said} ({_env_words(var, fallback if shown is None else shown)})"
    parser.add_argument(*names, var.option, **{**options, **extra})
