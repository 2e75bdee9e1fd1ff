"""Shared helpers for the sidecar, run, notice and demo tests (no tests here).

Real subprocesses: the packaged demo trainer (``python -m spotguard.demo.train``)
and ``spotguard sidecar``/``run``, each in its own process group and always
killed at the end of a test.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from spotguard.operator.testing import free_port as free_port

PY = sys.executable
STEP_RE = re.compile(r"^step (\d+) ")
#: A trainer's "preempted after step N". Its two writes (text, then newline) can
#: be split by another process's log line on the shared pipe, so the number may
#: come glued to a timestamp ("...step 462026-12-02 05:06:54,608 ...") and the
#: text may follow another line's end: search, never split on spaces.
STOPPED_RE = re.compile(r"preempted after step (\d+?)(?=\d{4}-\d\d-\d\d |\D|$)")


def wait_until(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll ``check`` until it returns something truthy; fail with ``what`` after ``timeout``.

    The timeout only bounds a hang; it asserts nothing about speed.
    """
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - "not yet"
            last_exc = exc
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what} (last error: {last_exc})")


class Proc:
    """A subprocess whose combined output is collected line by line in a thread."""

    def __init__(self, argv: list[str], env: Mapping[str, str], log: Path, cwd: Path | None = None) -> None:
        self.argv = argv
        self.log_path = log
        self.lines: list[str] = []
        self.last_step: int | None = None
        self._cond = threading.Condition()
        self.popen = subprocess.Popen(
            argv,
            env=dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        with self.log_path.open("a", encoding="utf-8") as logf:
            for raw in self.popen.stdout:
                line = raw.rstrip("\n")
                logf.write(line + "\n")
                logf.flush()
                with self._cond:
                    self.lines.append(line)
                    m = STEP_RE.match(line)
                    if m:
                        self.last_step = int(m.group(1))
                    self._cond.notify_all()

    def wait_for_line(self, pred: Callable[[str], bool], timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        with self._cond:
            seen = 0
            while True:
                for line in self.lines[seen:]:
                    if pred(line):
                        return line
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or (self.popen.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(f"{self.argv[:4]}: no matching line; output:\n{self.tail()}")
                self._cond.wait(min(left, 0.5))

    def wait_for_step(self, step: int, timeout: float = 120) -> int:
        line = self.wait_for_line(
            lambda ln: bool(STEP_RE.match(ln)) and int(STEP_RE.match(ln).group(1)) >= step,  # type: ignore[union-attr]
            timeout,
        )
        m = STEP_RE.match(line)
        assert m is not None
        return int(m.group(1))

    def wait_for_stopped_step(self, timeout: float = 120) -> int:
        """The step of the trainer's "preempted after step N" line, wherever it sits in the output."""
        m = STOPPED_RE.search(self.wait_for_line(lambda ln: bool(STOPPED_RE.search(ln)), timeout))
        assert m is not None
        return int(m.group(1))

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.popen.send_signal(sig)

    def wait(self, timeout: float = 120) -> int:
        try:
            rc = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.argv[:4]} did not exit; output:\n{self.tail()}") from None
        self._reader.join(timeout=10)
        return rc

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)

    def text(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    def tail(self, n: int = 40) -> str:
        """The last ``n`` lines, after any earlier line that names why a
        process died (a rank's abort scrolls out of view behind torchrun's
        summary of it)."""
        with self._cond:
            lines = list(self.lines)
        causes = [ln for ln in lines[:-n] if _CAUSE.search(ln)][-20:]
        head = ["(earlier lines naming a failure)", *causes, "(the last lines)"] if causes else []
        return "\n".join(head + lines[-n:])


#: Lines that say why a process died: a C++ abort, a fatal Python error, an exception.
_CAUSE = re.compile(
    r"terminate called|what\(\):|Fatal Python error|Traceback|Error\b|Exception\b|enforce fail|core dumped"
)


@contextlib.contextmanager
def reaping() -> Iterator[list[Proc]]:
    """Collects processes and kills whatever is left when the block ends."""
    procs: list[Proc] = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.popen.poll() is None:
                p.kill()


def train_argv(steps: int, output: Path | None = None, step_delay: float = 0.0, save_every: int = 25) -> list[str]:
    argv = [
        PY,
        "-m",
        "spotguard.demo.train",
        "--steps",
        str(steps),
        "--save-every",
        str(save_every),
        "--step-delay",
        str(step_delay),
        "--log-every",
        "1",
    ]
    if output is not None:
        argv += ["--output", str(output)]
    return argv


def uninterrupted_final(root: Path, steps: int, save_every: int, *extra: str) -> bytes:
    """The final weights of the demo trainer run without interruption (``extra``:
    more of its arguments): the reference a resumed run must match byte for byte.

    Tests take it from the ``reference_runs`` fixture, which makes each once per session.
    """
    root.mkdir(parents=True, exist_ok=True)
    out = root / "final.safetensors"
    with reaping() as procs:
        proc = Proc(
            [*train_argv(steps, out, save_every=save_every), *extra],
            base_env({"SPOTGUARD_CHECKPOINT_DIR": str(root / "ckpt")}),
            root / "train.log",
        )
        procs.append(proc)
        assert proc.wait() == 0, proc.tail()
    return out.read_bytes()


def spotguard_argv(*args: str) -> list[str]:
    return [PY, "-m", "spotguard.cli", *args]


def base_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The test's environment without inherited spotguard settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_") or k == "SPOTGUARD_TESTENV_RUN"}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def worker_env(s3_store: Any = None) -> dict[str, str]:
    """The environment of torchrun workers run from this checkout: one thread each, no spotguard settings."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    for key in list(env):
        if key.startswith("SPOTGUARD_"):
            del env[key]
    if s3_store is not None:
        env.update(s3_store.env())
    return env


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Scrape ``/metrics`` over HTTP: {(sample name, labels): value}."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def metric(samples: Mapping[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float | None:
    """The value of one sample whose labels include ``labels``; None if absent."""
    matches = [v for (n, lab), v in samples.items() if n == name and set(labels.items()) <= set(lab)]
    if not matches:
        return None
    assert len(matches) == 1, f"{name} {labels}: {len(matches)} samples"
    return matches[0]


def s3_storage(s3_store: Any, uri: str, **options: Any) -> Any:
    """Open ``uri`` in the test process with the test store's endpoint and credentials (and ``options``)."""
    from spotguard.storage import open_storage

    return open_storage(
        uri,
        endpoint_url=s3_store.endpoint_url,
        access_key=s3_store.access_key,
        secret_key=s3_store.secret_key,
        region=s3_store.region,
        **options,
    )


def small_parts(s3_store: Any, uri: str) -> Any:
    """The store with 5 MiB multipart parts, two at a time (the defaults put a small file's every
    part in flight at once, and a stop or a follow then shows nothing)."""
    mib = 1024 * 1024
    return s3_storage(s3_store, uri, multipart_threshold=5 * mib, multipart_chunksize=5 * mib, max_concurrency=2)


def sigterm_trainer_run(s3_store: Any, s3_uri: str, tmp_path: Path, nbytes: int, *flags: str) -> tuple[str, Path]:
    """``spotguard run`` (with ``flags``) of bench/sigterm_trainer.py holding ``nbytes`` of state, SIGTERM
    once it is ready; returns the supervisor's output and the state restored from the newest verified
    checkpoint (a directory), after checking that the run ended preempted."""
    from spotguard.checkpoint import latest_verified, restore_checkpoint

    root = Path(__file__).resolve().parents[2]
    argv = spotguard_argv(
        "run",
        "--workdir",
        str(tmp_path / "work"),
        "--storage",
        s3_uri,
        *flags,
        "--grace-seconds",
        "60",
        "--",
        sys.executable,
        str(root / "bench" / "sigterm_trainer.py"),
        "--bytes",
        str(nbytes),
    )
    env = base_env({**s3_store.env(), "SPOTGUARD_SAVE_EVERY_STEPS": "100000000", "PYTHONPATH": str(root)})
    with reaping() as procs:
        run = Proc(argv, env, tmp_path / "run.log")
        procs.append(run)
        run.wait_for_line(lambda ln: ln.strip() == "ready", 120)
        time.sleep(0.5)
        run.signal(signal.SIGTERM)
        assert run.wait(120) == 128 + signal.SIGTERM, run.tail()
    storage = s3_storage(s3_store, s3_uri)
    info, _ = latest_verified(storage)
    assert info is not None, run.text()
    return run.text(), Path(restore_checkpoint(storage, info.name, tmp_path / "restored").uri)


class StoreProxy:
    """An HTTP proxy in front of the real S3 store that can fail on demand, and counts requests.

    ``down()``: every connection is closed without an answer (the store is
    unreachable); ``fail_for(seconds)``: every request answers 500
    InternalError until then; ``up()``: requests pass through. ``requests``
    logs ``(time, method, path, status)`` of each request; SigV4 signatures
    stay valid because the Host header is passed on unchanged.
    """

    def __init__(self, upstream: str) -> None:
        import http.client
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import urlsplit

        up = urlsplit(upstream)
        self.lock = threading.Lock()
        self.requests: list[tuple[float, str, str, int]] = []
        self._down = False
        self._fail_until = 0.0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def handle_one_request(self) -> None:
                if proxy.is_down():
                    self.close_connection = True
                    with contextlib.suppress(OSError):
                        self.connection.shutdown(socket.SHUT_RDWR)
                    return
                super().handle_one_request()

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if proxy.failing():
                    payload = (
                        b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code>'
                        b"<Message>injected by the test</Message></Error>"
                    )
                    proxy.log(self.command, self.path, 500)
                    self.send_response(500)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("expect", "connection")}
                conn = http.client.HTTPConnection(up.hostname, up.port, timeout=60)
                try:
                    conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    for k, v in headers.items():
                        conn.putheader(k, v)
                    conn.endheaders(body)
                    resp = conn.getresponse()
                    data = resp.read()
                    where = self.path
                    if self.command == "POST" and "delete" in self.path and body:
                        # A batch delete names its keys in the body: logged with the path.
                        keys = re.findall(rb"<Key>(.*?)</Key>", body)
                        where += " keys=" + ",".join(k.decode(errors="replace") for k in keys)
                    proxy.log(self.command, where, resp.status)
                    self.send_response(resp.status)
                    for k, v in resp.getheaders():
                        if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                            self.send_header(k, v)
                    if self.command != "HEAD":
                        self.send_header("Content-Length", str(len(data)))
                    else:
                        self.send_header("Content-Length", resp.getheader("Content-Length") or "0")
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward  # noqa: N815 - http.server's naming

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base signature
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def is_down(self) -> bool:
        with self.lock:
            return self._down

    def failing(self) -> bool:
        with self.lock:
            return time.monotonic() < self._fail_until

    def log(self, method: str, path: str, status: int) -> None:
        with self.lock:
            self.requests.append((time.time(), method, path, status))

    def down(self) -> None:
        with self.lock:
            self._down = True

    def up(self) -> None:
        with self.lock:
            self._down = False
            self._fail_until = 0.0

    def fail_for(self, seconds: float) -> None:
        with self.lock:
            self._fail_until = time.monotonic() + seconds

    def since(self, when: float) -> list[tuple[float, str, str, int]]:
        with self.lock:
            return [r for r in self.requests if r[0] >= when]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)

    def env(self, s3_env: Mapping[str, str]) -> dict[str, str]:
        """The store's environment with the endpoint pointing at this proxy."""
        return {**s3_env, "AWS_ENDPOINT_URL_S3": self.url, "AWS_ENDPOINT_URL": self.url}


@contextlib.contextmanager
def store_proxy(s3_store: Any) -> Iterator[StoreProxy]:
    """A :class:`StoreProxy` in front of the test store for the duration of the block."""
    proxy = StoreProxy(s3_store.endpoint_url)
    try:
        yield proxy
    finally:
        proxy.close()
