"""``spotguard ckpt ls|verify|restore|gc|average|export`` and ``spotguard restore``.

Argument parsing and output only; the work is done by
:mod:`spotguard.checkpoint`. Errors a user can cause (bad URI, no
credentials, missing bucket, nothing to restore, a corrupt checkpoint) are
printed as one line and give a non-zero exit status.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spotguard.cliutil import command, depth_flags, error, options_from, progress_flag, usage
from spotguard.contract import env
from spotguard.contract.env import CHECKPOINT_DIR, STORAGE_URI, add_option
from spotguard.progress import ByteProgress

EXIT_OK = 0
EXIT_FAIL = 1

_CKPT_SEGMENT = re.compile(r"^ckpt-(\d{1,12})$")
#: ``ckpt gc``'s own names of retention options, besides the table's (``--metric`` for ``--best-metric``).
_RETENTION_NAMES = {env.BEST_METRIC.name: ("--metric",), env.BEST_MODE.name: ("--mode",)}


def register(subparsers: Any) -> None:
    """Add ``ckpt`` (with its subcommands) and ``restore`` to the top-level parser."""
    ckpt = subparsers.add_parser(
        "ckpt",
        help="inspect and manage checkpoints in storage",
        description="Inspect and manage checkpoints stored at URI (s3://BUCKET/PREFIX, gs://BUCKET/PREFIX or "
        "file:///PATH). S3 endpoint, region and credentials come from the standard AWS environment "
        "(AWS_ENDPOINT_URL_S3, AWS_DEFAULT_REGION, AWS_ACCESS_KEY_ID, ...); GCS credentials from Application "
        "Default Credentials (GOOGLE_APPLICATION_CREDENTIALS, Workload Identity).",
    )
    sub = ckpt.add_subparsers(dest="ckpt_command", metavar="SUBCOMMAND")
    ckpt.set_defaults(func=lambda args: usage(ckpt))

    p = command(sub, "ls", _guard(cmd_ls))
    p.add_argument("uri", metavar="URI")
    depth_flags(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = command(sub, "verify", _guard(cmd_verify))
    p.add_argument("uri", metavar="URI[/ckpt-N]")
    depth_flags(p, quick=False, deep_finds="finds damage that happened after the store accepted the data")

    p = command(sub, "restore", _guard(cmd_restore))
    p.add_argument("uri", metavar="URI[/ckpt-N]")
    p.add_argument("dest", metavar="DEST", type=Path)
    p.add_argument(
        "--plain",
        "--export",
        action="store_true",
        dest="plain",
        help="write a self-contained copy: whole files and a manifest without chunk references "
        "(for a checkpoint stored incrementally; to share it, or to hand the files to a framework)",
    )
    progress_flag(p)

    p = command(sub, "gc", _guard(cmd_gc))
    p.add_argument("uri", metavar="URI")
    rules = p.add_argument_group("retention", "the rules the uploaders take, their defaults from the same variables")
    for var in env.RETENTION:
        # The older short names first: they name the policy's fields (--metric, --mode).
        add_option(rules, var, *_RETENTION_NAMES.get(var.name, ()))
    p.add_argument(
        "--orphan-grace",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="delete incomplete prefixes, and chunks no checkpoint uses, only when untouched this long (default "
        "3600; at least the upload lease, SPOTGUARD_GC_LEASE_SECONDS, default 60)",
    )
    p.add_argument(
        "--stale-upload-age",
        type=float,
        default=6 * 3600.0,
        metavar="SECONDS",
        help="abort multipart uploads started this long ago (default 21600)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan, delete nothing")

    p = command(sub, "average", _guard(cmd_average))
    p.add_argument("uri", metavar="URI")
    p.add_argument("--last", type=_pos_int, required=True, metavar="K")
    p.add_argument("out", metavar="OUT", type=Path, help="output safetensors file")
    p.add_argument("--part", default="model", help="state part to average (default: model)")
    progress_flag(p)

    p = command(sub, "export", _guard(cmd_export))
    p.add_argument("uri", metavar="URI[/ckpt-N]")
    p.add_argument("dest", metavar="DEST", type=Path)
    p.add_argument("--format", choices=("hf",), required=True, help="hf: a Hugging Face model folder")
    p.add_argument(
        "--config",
        type=Path,
        metavar="PATH",
        help="the model's config.json, or a model directory (its tokenizer files come along); needed "
        "for a spotguard state, adds what a Trainer checkpoint lacks",
    )
    pick = p.add_mutually_exclusive_group()
    pick.add_argument("--best", metavar="METRIC", help="the verified checkpoint with the best recorded METRIC")
    pick.add_argument("--average", type=_pos_int, metavar="N", help="the element-wise mean of the last N verified")
    p.add_argument("--mode", choices=("min", "max"), default="min", help="for --best: lower or higher is better")
    p.add_argument("--part", default="model", help="state part holding the model's state_dict (default: model)")
    p.add_argument(
        "--max-shard-size",
        type=_size,
        default="5GB",
        metavar="SIZE",
        help="split model.safetensors above this size, with an index (default 5GB)",
    )
    p.add_argument("--force", action="store_true", help="replace a DEST that is not empty")
    progress_flag(p)

    p = command(subparsers, "restore", _guard(cmd_init_restore))
    add_option(p, STORAGE_URI, metavar="URI")
    add_option(p, CHECKPOINT_DIR, "--dest", type=Path, metavar="DIR")
    p.add_argument(
        "--grant",
        action="store_true",
        help="where the store signs reads, grant the trainer reads of the newest checkpoints instead "
        "(restore-grant.json in the control directory; a sidecar restores the local copy after the "
        "trainer's answer); else restore as without it",
    )
    progress_flag(p)


# -- plumbing --------------------------------------------------------------------


class UserError(Exception):
    """A problem the user can fix; printed as one line."""


def _pos_int(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {raw}")
    return value


def _guard(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Run a command, turning user-caused errors into one line and exit 1."""

    def run(args: argparse.Namespace) -> int:
        from spotguard.checkpoint.format.manifest import ManifestError
        from spotguard.checkpoint.local.codec import StateError
        from spotguard.checkpoint.store.stored import CheckpointCorruptError
        from spotguard.storage import StorageError

        # The commands print what the library would log (skips, problems).
        lib_log = logging.getLogger("spotguard.checkpoint")
        if not logging.getLogger().handlers and not lib_log.handlers:
            lib_log.addHandler(logging.NullHandler())
        try:
            return fn(args)
        except (UserError, StorageError, ManifestError, StateError, CheckpointCorruptError, ValueError) as exc:
            error(str(exc))
        except OSError as exc:
            where = f" ({exc.filename})" if exc.filename else ""
            error(f"{exc.strerror or exc}{where}")
        except KeyboardInterrupt:
            error("interrupted")
            return 130
        return EXIT_FAIL

    run.__name__ = fn.__name__
    run.__doc__ = fn.__doc__
    return run


def split_checkpoint_uri(uri: str) -> tuple[str, str | None]:
    """``URI/ckpt-N`` -> (``URI``, ``ckpt-<N:012d>``); other URIs -> (uri, None)."""
    stripped = uri.rstrip("/")
    head, sep, last = stripped.rpartition("/")
    m = _CKPT_SEGMENT.match(last)
    if sep and m and head and not head.endswith(":/"):
        from spotguard.checkpoint.format.manifest import checkpoint_name

        return head, checkpoint_name(int(m.group(1)))
    return stripped, None


def _open(uri: str) -> Any:
    from spotguard.storage import NotFoundError, open_storage

    storage = open_storage(uri)
    try:
        storage.check()
    except NotFoundError as exc:
        raise UserError(f"{exc} (storage {uri})") from None
    return storage


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _metrics_str(metrics: dict[str, float | None]) -> str:
    return ",".join(f"{k}={v:.6g}" if v is not None else f"{k}=-" for k, v in sorted(metrics.items())) or "-"


# -- commands ------------------------------------------------------------------------


def cmd_ls(args: argparse.Namespace) -> int:
    """list checkpoints: step, time, size, metrics, verified yes/no and why"""
    from spotguard.checkpoint.store.stored import list_checkpoint_names, read_latest_pointer
    from spotguard.checkpoint.store.verify_stored import verify_checkpoint

    storage = _open(args.uri)
    names = list_checkpoint_names(storage)
    pointer = read_latest_pointer(storage)
    rows: list[dict[str, Any]] = []
    previous: set[str] = set()
    for name in names:
        result = verify_checkpoint(storage, name, checksums=not args.quick, deep=args.deep)
        m = result.manifest
        new_bytes = None
        if m is not None and m.chunked:
            # Stored incrementally: what this checkpoint added over the one listed before it.
            refs = m.chunk_refs()
            new_bytes = sum(r.size for d, r in refs.items() if d not in previous)
            previous = set(refs)
        rows.append(
            {
                "sharding": _sharding_row(result),
                "name": name,
                "step": int(name.split("-")[1]),
                "created": m.created if m else None,
                "size": m.total_size if m else None,
                "format_version": m.format_version if m else None,
                "new_bytes": new_bytes,
                "epoch": m.epoch if m else None,
                "metrics": dict(m.metrics) if m else {},
                "verified": result.ok,
                "method": result.method,
                "problems": result.problems,
                "latest": pointer == int(name.split("-")[1]),
            }
        )
    if args.json:
        print(json.dumps({"uri": storage.uri, "checkpoints": rows}, indent=1))
        return EXIT_OK
    if not rows:
        print(f"no checkpoints at {storage.uri}")
        return EXIT_OK
    # The SHARDS column appears when a distributed checkpoint is listed.
    sharded = any(r["sharding"] is not None for r in rows)
    shards_head = f"{'SHARDS':<16}  " if sharded else ""
    # The NEW column (bytes a checkpoint stored incrementally added) appears when one is listed.
    chunked = any(r["new_bytes"] is not None for r in rows)
    new_head = f"{'NEW':>10}  " if chunked else ""
    print(f"{'STEP':>12}  {'CREATED':<20}  {'SIZE':>10}  {new_head}{shards_head}{'METRICS':<24}  VERIFIED")
    for r in rows:
        created = r["created"][:19].replace("T", " ") if r["created"] else "-"
        size = _human(r["size"]) if r["size"] is not None else "-"
        ok = "yes (sizes only)" if args.quick else "yes"
        verified = ok if r["verified"] else "no: " + "; ".join(r["problems"])
        mark = "*" if r["latest"] else " "
        shards = f"{_sharding_str(r['sharding']):<16}  " if sharded else ""
        new = f"{_human(r['new_bytes']) if r['new_bytes'] is not None else '-':>10}  " if chunked else ""
        print(
            f"{r['step']:>12}{mark} {created:<20}  {size:>10}  {new}{shards}"
            f"{_metrics_str(r['metrics']):<24}  {verified}"
        )
    return EXIT_OK


def _sharding_row(result: Any) -> dict[str, Any] | None:
    """``ls --json``'s ``sharding``: None for a single-process checkpoint (or an
    interrupted upload without parts); else world size (None when no global
    manifest), parts and the parts present."""
    m = result.manifest
    if m is not None and m.sharding is not None:
        return {
            "world_size": m.sharding.world_size,
            "parts": m.sharding.parts,
            "parts_present": list(range(m.sharding.parts)),
            "complete": True,
        }
    if result.parts_total is not None or result.parts_present:
        return {
            "world_size": None,
            "parts": result.parts_total,
            "parts_present": list(result.parts_present or []),
            "complete": False,
        }
    return None


def _sharding_str(sharding: dict[str, Any] | None) -> str:
    """``4 ranks/2 parts`` for a committed distributed checkpoint, ``parts 1/2`` for one waiting for parts."""
    if sharding is None:
        return "-"
    if sharding["complete"]:
        return f"{sharding['world_size']} ranks/{sharding['parts']} parts"
    total = sharding["parts"] if sharding["parts"] is not None else "?"
    return f"parts {len(sharding['parts_present'])}/{total}"


def cmd_verify(args: argparse.Namespace) -> int:
    """verify checkpoints (all, or URI/ckpt-N); non-zero exit names what is bad"""
    from spotguard.checkpoint.store.stored import list_checkpoint_names
    from spotguard.checkpoint.store.verify_stored import verify_checkpoint

    root, name = split_checkpoint_uri(args.uri)
    storage = _open(root)
    names = [name] if name else list_checkpoint_names(storage)
    if not names:
        raise UserError(f"no checkpoints at {storage.uri}")
    failed = 0
    for n in names:
        result = verify_checkpoint(storage, n, deep=args.deep)
        if result.ok and result.manifest is not None:
            m = result.manifest
            shards = f", {m.sharding.world_size} ranks in {m.sharding.parts} parts" if m.sharding is not None else ""
            print(
                f"{n}: ok ({len(m.files)} files, {_human(m.total_size)}, {m.checksum_algorithm}{shards}, "
                f"by {result.method or 'manifest'})"
            )
        else:
            failed += 1
            print(f"{n}: FAILED")
            for problem in result.problems:
                print(f"  {storage.uri_for(n)}/{problem}")
    if failed:
        error(f"{failed} of {len(names)} checkpoint(s) failed verification")
        return EXIT_FAIL
    return EXIT_OK


def _restore(uri: str, dest: Path, progress: bool | None, *, name: str | None = None, plain: bool = False) -> Any:
    from spotguard.checkpoint.restore.load import restore_checkpoint
    from spotguard.checkpoint.store.stored import CheckpointCorruptError, list_checkpoint_names, read_manifest

    storage = _open(uri)
    names = [name] if name else list(reversed(list_checkpoint_names(storage)))
    for n in names:
        try:
            total = read_manifest(storage, n).total_size
        except Exception:  # noqa: BLE001 - the size only sizes the bar; restoring reports a bad manifest
            total = 0
        bar = ByteProgress(total, f"restoring {n}", progress)
        try:
            info = restore_checkpoint(storage, n, dest, progress=bar, plain=plain)
        except CheckpointCorruptError as exc:
            if name:
                raise
            print(f"spotguard: skipped {n}: {'; '.join(exc.problems)}", file=sys.stderr)
            continue
        finally:
            bar.close() if bar.done else None
        return info
    return None


def cmd_restore(args: argparse.Namespace) -> int:
    """download the newest verified checkpoint (or URI/ckpt-N) into DEST

    The checkpoint is written to DEST/ckpt-<step>/.
    """
    root, name = split_checkpoint_uri(args.uri)
    info = _restore(root, args.dest, args.progress, name=name, plain=args.plain)
    if info is None:
        raise UserError(f"nothing to restore: no verified checkpoint at {root}")
    print(f"restored {info.name} (step {info.step}, {_human(info.size)}) into {info.uri}")
    return EXIT_OK


def cmd_init_restore(args: argparse.Namespace) -> int:
    """stage the newest verified checkpoint for a trainer (init container)

    Download the newest verified checkpoint into DEST/ckpt-<step>/. Exits 0 also when there is none yet.
    """
    if not args.storage:
        raise UserError(f"no storage URI: pass --storage URI or set {STORAGE_URI.name}")
    if args.dest is None:
        raise UserError(f"no destination: pass --dest DIR or set {CHECKPOINT_DIR.name}")
    if args.grant and _grant(args.storage, args.dest):
        return EXIT_OK
    info = _restore(args.storage, args.dest, args.progress)
    if info is None:
        print(f"no verified checkpoint at {args.storage} yet; the trainer starts fresh")
        return EXIT_OK
    print(f"restored {info.name} (step {info.step}, {_human(info.size)}) into {info.uri}")
    _vouch(Path(info.uri), args.dest)
    return EXIT_OK


def _grant(uri: str, dest: Path) -> bool:
    """Write a restore grant of the newest checkpoints into the trainer's control directory
    instead of restoring one (:func:`~spotguard.checkpoint.restore.grant.grant_reads`); False
    when there is none (a store that cannot sign reads, nothing streamable, an error): restore then."""
    from spotguard.checkpoint.restore.grant import grant_reads
    from spotguard.contract.control import control_dir_from_env
    from spotguard.contract.grant import clear_restore_messages

    control = control_dir_from_env(Path(dest))
    clear_restore_messages(control)  # an earlier pod's grant or answer on this volume is never used
    try:
        granted = grant_reads(_open(uri), control)
    except Exception as exc:  # noqa: BLE001 - the restore below says what is wrong with the store
        print(f"spotguard: no restore grant ({' '.join(str(exc).split())}); restoring", file=sys.stderr)
        return False
    if granted is None:
        return False
    names = ", ".join(c.name for c in granted.checkpoints)
    print(f"granted the trainer reads of {names}; the sidecar restores its local copy after the trainer's answer")
    return True


def _vouch(path: Path, dest: Path) -> None:
    """Tell the trainer that ``path`` verified whole just now, so that it does not checksum it again."""
    from spotguard.checkpoint.format.manifest import ManifestError
    from spotguard.checkpoint.restore.load import vouch_restored
    from spotguard.contract.control import control_dir_from_env

    try:
        vouch_restored(control_dir_from_env(Path(dest)), path)
    except (OSError, ManifestError) as exc:  # the trainer then checksums it again: slower, never wrong
        print(f"spotguard: could not record that {path.name} verified: {exc}", file=sys.stderr)


def cmd_gc(args: argparse.Namespace) -> int:
    """apply retention, delete orphaned prefixes, abort stale multipart uploads

    Keep the checkpoints any rule keeps (the newest verified one always), delete the rest; also delete
    prefixes left by interrupted uploads and abort stale multipart uploads.
    """
    from spotguard.checkpoint.store.gc import collect_garbage
    from spotguard.checkpoint.store.intents import check_orphan_grace
    from spotguard.checkpoint.store.retention import RetentionPolicy

    if args.keep_best is not None and not args.metric:
        raise UserError("--keep-best needs --metric NAME")
    policy = options_from(RetentionPolicy, args)
    try:
        check_orphan_grace(args.orphan_grace)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    storage = _open(args.uri)
    report = collect_garbage(
        storage, policy, orphan_grace=args.orphan_grace, stale_upload_age=args.stale_upload_age, dry_run=args.dry_run
    )
    verb = "would delete" if args.dry_run else "deleted"
    if report.newest_verified is None:
        print(f"no verified checkpoint at {storage.uri}: retention deletes nothing")
    for name, reasons in sorted(report.plan.keep.items()):
        print(f"keep    {name}  ({', '.join(reasons)})")
    for name in report.deleted:
        print(f"{verb:<7} {name}  (retention)")
    for name in report.waiting:
        print(f"keep    {name}  (distributed checkpoint waiting for its other parts)")
    for name in report.orphans:
        print(f"{verb:<7} {name}  (orphaned: no manifest)")
    for upload in report.aborted_uploads:
        action = "would abort" if args.dry_run else "aborted"
        print(f"{action} stale upload of {upload.key}")
    if report.chunk_sweep_aborted:
        print(f"kept every chunk: {report.chunk_sweep_aborted}")
    elif report.chunks_deleted:
        print(
            f"{verb:<7} {len(report.chunks_deleted)} unused chunk(s), {_human(report.chunk_bytes_freed)} "
            "(no kept checkpoint uses them)"
        )
    return EXIT_OK


def cmd_average(args: argparse.Namespace) -> int:
    """element-wise mean of the weights of the last K verified checkpoints

    A single-process checkpoint holds the part averaged as PART.safetensors (a Hugging Face model
    folder: its weights, the part model); a distributed one holds it in its DCP files, which are
    fetched, checked and loaded whole; nested keys are joined with dots.
    """
    # stored_tensors.average_tensors does the work, for ``ckpt export --average`` too.
    from spotguard.checkpoint.restore import stored_tensors

    try:
        from safetensors.torch import save_file
    except ImportError:
        raise UserError("averaging needs torch and safetensors: pip install 'spotguard[torch]'") from None

    storage = _open(args.uri)
    chosen = stored_tensors.last_verified(storage, args.last, args.part, flag="--last", note=_note)
    with tempfile.TemporaryDirectory(prefix="spotguard-avg-") as tmp:
        out = stored_tensors.average_tensors(storage, chosen, args.part, Path(tmp), _bars(args.progress))
    what = stored_tensors.describe_part(stored_tensors.layout_of(chosen[0], args.part), args.part)
    part_file = f"{args.part}.safetensors"
    target = args.out / part_file if args.out.is_dir() else args.out
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = target.parent / f".{target.name}.tmp"
    save_file(out, str(tmp_out), metadata={"format": "pt", "spotguard_average_of": ",".join(m.name for m in chosen)})
    os.replace(tmp_out, target)
    steps = ", ".join(str(m.step) for m in chosen)
    print(f"averaged {len(out)} tensors of {what} over steps {steps} into {target}")
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    """write a verified checkpoint as a Hugging Face model folder (then: hf upload USER/MODEL DEST)

    Write the newest verified checkpoint (or URI/ckpt-N, the best by --best, the average of the last
    --average N) into DEST as a model folder from_pretrained loads and the Hub takes: a Trainer
    checkpoint's model files without its training state, or a spotguard state's model part as
    model.safetensors next to the --config. Nothing is unpickled; DEST appears whole or not at all.
    """
    from spotguard.checkpoint.tools import export

    root, name = split_checkpoint_uri(args.uri)
    storage = _open(root)
    result = export.export_hf(
        storage,
        name,
        args.dest,
        config=args.config,
        best=args.best,
        mode=args.mode,
        average=args.average,
        part=args.part,
        max_shard_size=args.max_shard_size,
        force=args.force,
        bars=_bars(args.progress),
        note=_note,
    )
    src = result.sources
    what = (
        f"the average of steps {', '.join(str(m.step) for m in src)}"
        if len(src) > 1
        else f"{src[0].name} (step {src[0].step})"
    )
    print(f"exported {what} to {result.dest}: {', '.join(result.files)}")
    weights = result.weights
    if weights is not None and weights.architecture is None:
        print("keys not checked against the model: its config names no architecture transformers has")
    if weights is not None and weights.prefix:
        print(f"removed the key prefix {weights.prefix!r}")
    for key, source in (weights.dropped if weights is not None else {}).items():
        print(f"left out {key}: tied to {source} (the model ties it again on load)")
    if result.left_out:
        print(f"left out (training state, not the model): {', '.join(result.left_out)}")
    print(f"to publish it: hf upload USER/MODEL {result.dest}")
    return EXIT_OK


def _note(message: str) -> None:
    print(f"spotguard: {message}", file=sys.stderr)


def _bars(progress: bool | None) -> Callable[[int, str], ByteProgress]:
    return lambda total, label: ByteProgress(total, label, progress)


def _size(raw: str) -> int:
    from spotguard.checkpoint.format.hf_folder import parse_size

    try:
        return parse_size(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
