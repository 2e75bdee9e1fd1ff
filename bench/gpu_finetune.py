"""The GPU check's ``finetune`` check: a 7B model's LoRA fine-tune, preempted and resumed.

The state is bench/incremental_worker.py's fine-tune shape on the GPU: a
frozen base of ``--frozen-gib`` in bfloat16 (14 GiB: a 7B model's weights)
and a 6 MiB adapter trained with AdamW. ``spotguard run`` supervises it with
``file://`` storage and incremental checkpoints (the default):

1. two routine checkpoints (the first stores the whole base, the second
   finds it unchanged), then SIGTERM: the emergency checkpoint must verify,
   upload no more than what changed (the adapter's 6 MiB and a little; on
   a GPU also less than 5% of the state), and the supervisor exit 143;
2. the same command on a new work directory (a new node: nothing local)
   restores from storage into a model whose base is zeros: the adapter and
   its optimizer state must equal the preempted ones, every base tensor the
   seed's;
3. after 3 more steps the adapter's digest must equal an uninterrupted run's.
"""

from __future__ import annotations

import re
import shutil
import signal
import sys
import time
from typing import NamedTuple

from bench.common import StageLine, stage_line
from bench.gpu_common import Check, CheckFailed, Child, Ctx, MiB, child_env, run_child
from bench.incremental_worker import ROUTINE

GiB = 1 << 30
ADAPTER_BYTES = 6 * MiB  # the adapter's parameters (2 MiB) and AdamW's two moments
MORE_STEPS = 3
PREEMPTED_RE = re.compile(r"preempted after step (\d+) digest ([0-9a-f]{64})")
RESUMED_RE = re.compile(r"resumed from step (\d+) digest ([0-9a-f]{64}) base_equal=(yes|no) seconds=([0-9.]+)")
FINAL_RE = re.compile(r"final step (\d+) digest ([0-9a-f]{64})")


class _Stage(NamedTuple):
    when: float  # when the line arrived (time.monotonic)
    line: StageLine


def _stages(child: Child, after: float = 0.0) -> list[_Stage]:
    """The supervisor's stage lines that arrived after ``after``."""
    found = []
    for when, text in list(child.lines):
        line = stage_line(text)
        if line is not None and when >= after:
            found.append(_Stage(when, line))
    return found


def _stage(stages: list[_Stage], stage: str, name: str | None = None) -> _Stage:
    """The first ``stage`` line (of checkpoint ``name``, if given)."""
    for s in stages:
        if s.line.stage == stage and (name is None or s.line.fields.get("name") == name):
            return s
    raise CheckFailed(f"no stage={stage} line{f' for {name}' if name else ''} in the supervisor's output")


def check_finetune(ctx: Ctx, c: Check) -> None:
    from spotguard.checkpoint import latest_verified
    from spotguard.checkpoint.format.manifest import checkpoint_name

    frozen = ctx.frozen_bytes
    dtype = "bfloat16" if ctx.cuda else "float32"
    params = frozen // (2 if ctx.cuda else 4)
    work = ctx.root / "finetune"
    work.mkdir()
    store = work / "store"
    worker = [
        sys.executable,
        "-m",
        "bench.incremental_worker",
        "finetune",
        "--frozen-bytes",
        str(frozen),
        "--trainable-bytes",
        str(ADAPTER_BYTES),
        "--device",
        ctx.device,
        "--dtype",
        dtype,
    ]

    def supervised(node: str, *more: str) -> list[str]:
        return [
            *(sys.executable, "-m", "spotguard.cli", "run", "--workdir", str(work / node)),
            *("--storage", f"file://{store}", "--max-restarts", "0", "--grace-seconds", "900", "--"),
            *worker,
            *more,
        ]

    env = child_env({"SPOTGUARD_SAVE_EVERY_STEPS": "100000000"})  # routine saves: steps 1 and 2 only
    env.pop("SPOTGUARD_INCREMENTAL", None)
    c.say(
        f"frozen base {frozen / GiB:g} GiB ({params / 1e9:.2f}B {dtype} parameters on {ctx.device}), "
        f"adapter + AdamW {ADAPTER_BYTES // MiB} MiB; incremental checkpoints to file:// storage"
    )

    # 1. Routine checkpoints, then SIGTERM.
    first = Child(supervised("node1"), env, work / "preempted.log")
    try:
        first.wait_for(lambda ln: ln.strip() == "ready", ctx.timeout * 2)
        routine = f"name=ckpt-{ROUTINE:012d}"
        first.wait_for(lambda ln: "stage=pointer " in ln and routine in ln, ctx.timeout * 2)
        time.sleep(0.5)  # a few more training steps
        sent = time.monotonic()
        first.popen.send_signal(signal.SIGTERM)
        rc = first.wait(ctx.timeout)
    finally:
        first.kill()
    first_name = checkpoint_name(1)
    stages = _stages(first)
    full, full_verify = _stage(stages, "upload", first_name).line, _stage(stages, "verify", first_name).line
    c.say(
        f"first checkpoint (the whole state): upload {full.seconds:.2f}s "
        f"({frozen / GiB / max(full.seconds, 1e-9):.2f} GiB/s), verify {full_verify.seconds:.2f}s"
    )
    c.fig("first_upload_s", full.seconds)
    c.fig("first_verify_s", full_verify.seconds)
    if rc != 128 + signal.SIGTERM:
        raise CheckFailed(f"spotguard run exited {rc} after SIGTERM, not 143:\n{first.tail()}")
    preempted = first.find(PREEMPTED_RE)
    if preempted is None:
        raise CheckFailed(f"no 'preempted after step' line:\n{first.tail()}")
    stopped, stopped_digest = int(preempted[1].group(1)), preempted[1].group(2)
    name = checkpoint_name(stopped)
    after = _stages(first, sent)
    save, upload = _stage(after, "save", name).line, _stage(after, "upload", name).line
    verify = _stage(after, "verify", name)
    uploaded = int(upload.fields.get("bytes", -1))
    total = uploaded + int(upload.fields.get("reused_bytes", 0))
    share = uploaded / total if total > 0 else 1.0
    to_verified = c.fig("sigterm_to_verified_s", round(verify.when - sent, 3))
    c.fig("emergency_uploaded_bytes", uploaded)
    c.fig("emergency_uploaded_share", round(share, 5))
    c.say(
        f"preempted after step {stopped}: SIGTERM -> verified {to_verified:.2f}s (save {save.seconds:.2f}s, "
        f"upload {upload.seconds:.2f}s, verify {verify.line.seconds:.2f}s); uploaded {uploaded / MiB:.1f} MiB "
        f"of {total / GiB:.2f} GiB ({100 * share:.2f}%)"
    )
    if uploaded > ADAPTER_BYTES + MiB:  # the adapter, its moments, the step and RNG states: what changed
        raise CheckFailed(f"the emergency checkpoint uploaded {uploaded / MiB:.1f} MiB: more than what changed")
    if ctx.cuda and share >= 0.05:
        raise CheckFailed(f"the emergency checkpoint uploaded {100 * share:.1f}% of the state, not < 5%")

    from spotguard.storage import open_storage

    info, _ = latest_verified(open_storage(f"file://{store}"))
    if info is None or info.step != stopped:
        raise CheckFailed(f"storage's newest verified checkpoint is {info}, not step {stopped}")
    shutil.rmtree(work / "node1", ignore_errors=True)  # the node is gone

    # 2. A new node resumes from storage.
    t0 = time.monotonic()
    again = run_child(supervised("node2", "--resume-steps", str(MORE_STEPS)), env, work / "resumed.log", ctx.timeout)
    resumed, final = again.find(RESUMED_RE), again.find(FINAL_RE)
    if resumed is None or final is None:
        raise CheckFailed(f"the resumed run printed no 'resumed from step' or no final digest:\n{again.tail()}")
    step, digest, base_ok = int(resumed[1].group(1)), resumed[1].group(2), resumed[1].group(3) == "yes"
    load_s = float(resumed[1].group(4))
    fetch_s = _stage(_stages(again), "restore").line.seconds
    c.fig("restore_fetch_s", fetch_s)
    c.fig("restore_load_s", load_s)
    c.say(
        f"new node: fetched {name} from storage in {fetch_s:.2f}s, loaded into the model in {load_s:.2f}s "
        f"({time.monotonic() - t0:.1f}s in all); adapter and optimizer equal the preempted: "
        f"{'yes' if digest == stopped_digest else 'no'}; every base tensor equals the seed's: "
        f"{'yes' if base_ok else 'no'}"
    )
    if step != stopped or digest != stopped_digest or not base_ok:
        raise CheckFailed(
            f"resumed step {step} (expected {stopped}), same adapter {digest == stopped_digest}, base {base_ok}"
        )
    shutil.rmtree(work / "node2", ignore_errors=True)

    # 3. Continued training equals uninterrupted training.
    end_step, end_digest = int(final[1].group(1)), final[1].group(2)
    ref = run_child([*worker, "--reference-steps", str(end_step)], env, work / "reference.log", ctx.timeout)
    ref_final = ref.find(FINAL_RE)
    if ref_final is None:
        raise CheckFailed(f"the uninterrupted run printed no final digest:\n{ref.tail()}")
    same = c.fig("bit_exact", ref_final[1].group(2) == end_digest)
    c.say(f"after {MORE_STEPS} more steps (step {end_step}), equal to an uninterrupted run: {'yes' if same else 'no'}")
    if not same:
        raise CheckFailed(f"final digest {end_digest} differs from the uninterrupted run's {ref_final[1].group(2)}")


def frozen_default(cuda: bool, quick: bool) -> int:
    """The frozen base's default size: a 7B model's bfloat16 weights on a GPU, small on CPU."""
    if cuda:
        return (1 if quick else 14) * GiB
    return 64 * MiB
