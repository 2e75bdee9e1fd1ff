"""The checkpoint contract: format, atomic commit, upload, verification, retention.

Public API (others import these; see ``docs/checkpoint-format.md``):

- :func:`upload_checkpoint`, :func:`commit_global` (distributed checkpoints),
  :func:`verify_checkpoint`, :func:`latest_verified` (and
  :class:`LatestWatch`, the same for pollers),
  :func:`restore_latest`, :func:`apply_retention`, :func:`list_local_committed`;
- :class:`Manifest` and friends for reading manifests;
- :class:`RetentionPolicy` and the pure :func:`plan_retention`.

The package is five rooms, each importing only the rooms below it (checked by
``lint-imports``): ``tools`` (the ``spotguard ckpt`` commands, export),
``restore`` (store -> trainer), ``store`` (upload, parts, verify, publish,
latest, retention, gc), ``local`` (state -> files on this machine: codec,
snapshot, atomic commit, staging) and ``format`` (manifest, chunks, checks,
foreign formats read without running code).

Importing this package does not import torch, numpy or boto3.
"""

from __future__ import annotations

from spotguard.checkpoint.format.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    POINTER_NAME,
    FileEntry,
    Manifest,
    ManifestError,
    Sharding,
    checkpoint_name,
    parse_checkpoint_name,
    parse_manifest,
    part_manifest_path,
)
from spotguard.checkpoint.format.verify import VerifyResult
from spotguard.checkpoint.local.codec import StateError, snapshot_state
from spotguard.checkpoint.local.commit import (
    DeadlineExceeded,
    LocalWriter,
    clean_stale_tmp,
    list_local_committed,
    load_checkpoint_state,
    prune_local,
    read_local_manifest,
    remove_checkpoint_dir,
    verify_local_checkpoint,
    write_checkpoint,
)
from spotguard.checkpoint.restore.load import restore_checkpoint, restore_latest
from spotguard.checkpoint.store.chunked import KnownChunks
from spotguard.checkpoint.store.gc import GcReport, apply_retention, collect_garbage, find_orphans, stale_uploads
from spotguard.checkpoint.store.global_manifest import build_global_manifest
from spotguard.checkpoint.store.latest import LatestWatch, latest_verified
from spotguard.checkpoint.store.parts import GlobalCommit, commit_global, read_parts
from spotguard.checkpoint.store.retention import RetentionCandidate, RetentionPlan, RetentionPolicy, plan_retention
from spotguard.checkpoint.store.stored import (
    CheckpointCorruptError,
    CheckpointInfo,
    Skipped,
    delete_checkpoint,
    list_checkpoint_names,
    read_latest_pointer,
    read_manifest,
    update_latest_pointer,
)
from spotguard.checkpoint.store.upload import UploadResult, upload_checkpoint
from spotguard.checkpoint.store.verify_stored import verify_checkpoint
from spotguard.storage.checksum import ALGORITHMS, DEFAULT_ALGORITHM

__all__ = [
    "KnownChunks",
    "ALGORITHMS",
    "DEFAULT_ALGORITHM",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "POINTER_NAME",
    "CheckpointCorruptError",
    "CheckpointInfo",
    "DeadlineExceeded",
    "FileEntry",
    "GcReport",
    "GlobalCommit",
    "LatestWatch",
    "LocalWriter",
    "Manifest",
    "ManifestError",
    "RetentionCandidate",
    "RetentionPlan",
    "RetentionPolicy",
    "Sharding",
    "Skipped",
    "StateError",
    "UploadResult",
    "VerifyResult",
    "apply_retention",
    "build_global_manifest",
    "checkpoint_name",
    "clean_stale_tmp",
    "collect_garbage",
    "commit_global",
    "delete_checkpoint",
    "find_orphans",
    "latest_verified",
    "list_checkpoint_names",
    "list_local_committed",
    "load_checkpoint_state",
    "parse_checkpoint_name",
    "parse_manifest",
    "part_manifest_path",
    "plan_retention",
    "prune_local",
    "read_latest_pointer",
    "read_local_manifest",
    "read_manifest",
    "read_parts",
    "remove_checkpoint_dir",
    "restore_checkpoint",
    "restore_latest",
    "snapshot_state",
    "stale_uploads",
    "update_latest_pointer",
    "upload_checkpoint",
    "verify_checkpoint",
    "verify_local_checkpoint",
    "write_checkpoint",
]
