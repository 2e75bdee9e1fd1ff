"""spotguard's own admission server, served by every operator replica (leader and standbys alike).

Admission is not leader-elected (as in controller-runtime): the webhook
Service sends each request to any ready replica, so every replica answers,
from process start to exit, in a thread and event loop of its own (kopf's
loop, and a standby's blocking wait for the Lease, do not matter to it).

Wire protocol: AdmissionReview ``admission.k8s.io/v1`` over HTTPS (POST, JSON),
on fixed paths:

==============================  ==============================================
``/mutate-pods``                sidecar injection into pods labelled
                                ``spotguard.dev/inject: "true"`` (CREATE): a
                                JSONPatch, or a denial (400) naming the bad
                                annotation (:mod:`spotguard.operator.webhook`)
``/inject-sidecar``             the same: the path of earlier releases, whose
                                webhook configuration may still name it
``/validate-trainingjobs``      refuses a TrainingJob UPDATE that would
                                silently throw a running job's progress away
                                (:func:`~spotguard.operator.specchange.restart_refusal`,
                                which the operator applies too)
==============================  ==============================================

The certificate and key are read again when their files change (a renewed
Secret, cert-manager), without a restart. Until the server listens (the port
taken, the certificate unreadable) it retries, and ``serving()`` is False,
which the operator's ``/readyz`` reports.

The decisions are pure functions of the review (:func:`review_response` and
what it calls), tested without I/O; :class:`AdmissionServer` does the I/O.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import ssl
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from aiohttp import web

from spotguard.operator.apierrors import api_reason, api_status
from spotguard.operator.background import BackgroundThread
from spotguard.operator.podbuilder import LABEL_INJECT, OperatorConfig
from spotguard.operator.spec import GROUP, PLURAL

# Re-exported: the names earlier releases had here.
from spotguard.operator.specchange import ALLOW_RESTART_ANNOTATION as ALLOW_RESTART_ANNOTATION
from spotguard.operator.specchange import restart_refusal as restart_refusal
from spotguard.operator.specfields import SpecError
from spotguard.operator.webhook import apply_to_patch

log = logging.getLogger("spotguard.operator")

MUTATE_PATH = "/mutate-pods"
#: The path kopf served the injection on (its handler id), kept so that an old configuration still works.
LEGACY_MUTATE_PATH = "/inject-sidecar"
VALIDATE_PATH = "/validate-trainingjobs"
#: The webhook names of the configurations (the chart's, and ``--webhook-manage``'s).
MUTATING_WEBHOOK = "inject-sidecar.spotguard.dev"
VALIDATING_WEBHOOK = "trainingjob-updates.spotguard.dev"
REVIEW_VERSIONS = ("admission.k8s.io/v1", "admission.k8s.io/v1beta1")
#: An UPDATE review carries the object twice; each may be as large as etcd allows (1.5 MiB).
MAX_REVIEW_BYTES = 8 * 1024 * 1024
#: How often the certificate files are looked at (two stat calls).
RELOAD_SECONDS = 1.0
#: How long to wait before trying again to listen, or to find the sidecar mode.
RETRY_SECONDS = 1.0


# --- pure: reviews, patches, decisions ----------------------------------------------


def escape_pointer(key: str) -> str:
    """Pure: ``key`` as one JSON Pointer segment (RFC 6901: ``~`` is ``~0``, ``/`` is ``~1``)."""
    return key.replace("~", "~0").replace("/", "~1")


def json_patch(obj: Mapping[str, Any], patch: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Pure: JSONPatch operations that turn ``obj`` into ``obj`` merged with ``patch``.

    ``patch`` is a merge of the object's new values: top-level fields are set
    as a whole (``spec``), ``metadata``'s maps key by key. An ``add`` of a
    member that exists replaces it (RFC 6902), but a map that is absent (a pod
    without ``metadata.annotations``) must be added whole: a path through a
    missing member fails the whole patch.
    """
    ops: list[dict[str, Any]] = []
    for key, value in patch.items():
        if key != "metadata" or not isinstance(value, Mapping):
            ops.append({"op": "add", "path": f"/{escape_pointer(key)}", "value": value})
            continue
        meta = obj.get("metadata")
        if not isinstance(meta, Mapping):
            ops.append({"op": "add", "path": "/metadata", "value": value})
            continue
        for field, entries in value.items():
            base = f"/metadata/{escape_pointer(field)}"
            if not isinstance(entries, Mapping) or not isinstance(meta.get(field), Mapping):
                ops.append({"op": "add", "path": base, "value": entries})
                continue
            for k, v in entries.items():
                ops.append({"op": "add", "path": f"{base}/{escape_pointer(k)}", "value": v})
    return ops


def request_namespace(request: Mapping[str, Any]) -> str | None:
    """Pure: the namespace of an admission request's object: its own, else the request's.

    A pod being created often has no ``metadata.namespace`` yet; the request
    carries it beside the object.
    """
    obj = request.get("object")
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    own = meta.get("namespace") if isinstance(meta, Mapping) else None
    return str(own or request.get("namespace") or "") or None


def allowed(uid: str) -> dict[str, Any]:
    """Pure: an admission response that lets the request through unchanged."""
    return {"uid": uid, "allowed": True}


def denied(uid: str, code: int, reason: str, message: str) -> dict[str, Any]:
    """Pure: an admission response that refuses the request; the apiserver shows ``message`` to the user."""
    return {
        "uid": uid,
        "allowed": False,
        "status": {"status": "Failure", "code": code, "reason": reason, "message": message},
    }


def mutate_pod(request: Mapping[str, Any], config: OperatorConfig) -> dict[str, Any]:
    """Pure: the response to a pod's admission: the sidecar injected (a JSONPatch), or a denial (400)."""
    uid = str(request.get("uid") or "")
    pod = request.get("object")
    labels = ((pod or {}).get("metadata") or {}).get("labels") if isinstance(pod, Mapping) else None
    # The configuration selects these already; a wider one (edited by hand) changes nothing else.
    if request.get("operation") != "CREATE" or not isinstance(labels, Mapping) or labels.get(LABEL_INJECT) != "true":
        return allowed(uid)
    assert isinstance(pod, Mapping)
    patch: dict[str, Any] = {}
    try:
        apply_to_patch(pod, patch, request_namespace(request), config)
    except SpecError as exc:
        return denied(uid, 400, "BadRequest", f"spotguard: {exc}")
    ops = json_patch(pod, patch)
    return {**allowed(uid), "patchType": "JSONPatch", "patch": base64.b64encode(json.dumps(ops).encode()).decode()}


def validate_trainingjob(request: Mapping[str, Any], namespaces: Collection[str] = ()) -> dict[str, Any]:
    """Pure: the response to a TrainingJob's admission (``namespaces``: those the operator serves; empty: all)."""
    uid = str(request.get("uid") or "")
    if request.get("operation") != "UPDATE" or request.get("subResource"):
        return allowed(uid)  # the status subresource is the operator's own
    if namespaces and request.get("namespace") not in namespaces:
        return allowed(uid)  # another operator's job (the configuration itself selects no namespace)
    old, new = request.get("oldObject"), request.get("object")
    if not isinstance(old, Mapping) or not isinstance(new, Mapping):
        return allowed(uid)
    message = restart_refusal(old, new)
    return allowed(uid) if message is None else denied(uid, 422, "Invalid", message)


def review_response(
    path: str, review: Any, config: OperatorConfig | None, namespaces: Collection[str] = ()
) -> tuple[int, dict[str, Any]]:
    """Pure: the HTTP status and JSON body answering an AdmissionReview posted to ``path``.

    The response's ``apiVersion`` is the review's own (v1; v1beta1 has the same shape).
    """
    if not isinstance(review, Mapping) or not isinstance(review.get("request"), Mapping):
        return 400, {"error": "expected an AdmissionReview with a request"}
    version = review.get("apiVersion") if review.get("apiVersion") in REVIEW_VERSIONS else REVIEW_VERSIONS[0]
    request: Mapping[str, Any] = review["request"]
    if path in (MUTATE_PATH, LEGACY_MUTATE_PATH):
        if config is None:
            return 503, {"error": "not serving yet"}
        response = mutate_pod(request, config)
    elif path == VALIDATE_PATH:
        response = validate_trainingjob(request, namespaces)
    else:
        return 404, {"error": f"no webhook at {path}"}
    return 200, {"apiVersion": version, "kind": "AdmissionReview", "response": response}


def webhook_configurations(
    name: str, base_url: str, ca_bundle: bytes, timeout_seconds: int = 10
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Pure: the Mutating- and ValidatingWebhookConfiguration ``name`` for a server at ``base_url``
    (``--webhook-manage``; the chart writes its own, for its Service)."""
    bundle = base64.b64encode(ca_bundle).decode()

    def configuration(kind: str, hook: str, path: str, rule: dict[str, Any], **policy: Any) -> dict[str, Any]:
        """One configuration of one webhook, for the requests ``rule`` names, served at ``path``."""
        webhook = {
            "name": hook,
            "admissionReviewVersions": ["v1"],
            "sideEffects": "None",
            "timeoutSeconds": timeout_seconds,
            **policy,
            "rules": [{**rule, "scope": "Namespaced"}],
            "clientConfig": {"url": f"{base_url}{path}", "caBundle": bundle},
        }
        return {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": kind,
            "metadata": {"name": name},
            "webhooks": [webhook],
        }

    mutating = configuration(
        "MutatingWebhookConfiguration",
        MUTATING_WEBHOOK,
        MUTATE_PATH,
        {"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"]},
        failurePolicy="Fail",
        objectSelector={"matchLabels": {LABEL_INJECT: "true"}},
    )
    validating = configuration(
        "ValidatingWebhookConfiguration",
        VALIDATING_WEBHOOK,
        VALIDATE_PATH,
        {"operations": ["UPDATE"], "apiGroups": [GROUP], "apiVersions": ["*"], "resources": [PLURAL]},
        # Ignore: an operator that is down must not block every edit of every job.
        failurePolicy="Ignore",
    )
    return mutating, validating


# --- I/O ----------------------------------------------------------------------------


def _files_signature(paths: Sequence[str]) -> tuple[tuple[int, int, int], ...] | None:
    """What changes when a file is rewritten or its Secret volume swaps the link (None: one is missing)."""
    try:
        return tuple((st.st_mtime_ns, st.st_size, st.st_ino) for st in (os.stat(p) for p in paths))
    except OSError:
        return None


class AdmissionServer(BackgroundThread):
    """The admission webhooks over TLS, in a thread and event loop of its own.

    ``config`` gives the operator's configuration for the injection; it runs
    once, in a worker thread (it may ask the apiserver whether native sidecars
    are supported), and is tried again until it works. ``manage`` (optional)
    is called once the server listens, in a worker thread, to register the
    webhook configurations (``--webhook-manage``).
    """

    thread_name = "admission"

    def __init__(
        self,
        address: str,
        port: int,
        certfile: str,
        keyfile: str,
        config: Callable[[], OperatorConfig],
        *,
        namespaces: Collection[str] = (),
        manage: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self.address = address
        self.port = port
        self.certfile = certfile
        self.keyfile = keyfile
        self.config_source = config
        self.namespaces = frozenset(namespaces)
        self.manage = manage
        self.config: OperatorConfig | None = None
        self._listening = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake_event: asyncio.Event | None = None

    # -- lifecycle: start() serves in the background (see :meth:`serving`), stop() ends it

    def _wake(self) -> None:
        """Wake the event loop's pause, so that it sees the stop and stops listening."""
        loop, wake = self._loop, self._wake_event
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed already
                loop.call_soon_threadsafe(wake.set)

    def serving(self, timeout: float = 2.0) -> bool:
        """Whether the server listens and its loop answers (within ``timeout``)."""
        loop = self._loop
        if not self._listening or loop is None or self._thread is None or not self._thread.is_alive():
            return False
        try:
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(timeout)
        except Exception:  # noqa: BLE001 - a closed loop, or one that does not answer: not serving
            return False
        return self._listening

    # -- the loop

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        except Exception:  # noqa: BLE001 - logged whatever stopped the server; the probes then say not serving
            log.exception("the admission server stopped")
        finally:
            self._listening = False
            loop.close()

    async def _pause(self, seconds: float) -> None:
        """Sleep, or return early when asked to stop."""
        assert self._wake_event is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake_event.wait(), seconds)

    async def _main(self) -> None:
        self._wake_event = asyncio.Event()
        if self._stop.is_set():  # checked after the event exists: a stop() in between is not lost
            return
        await self._load_config()
        if self.config is None:
            return
        app = web.Application(client_max_size=MAX_REVIEW_BYTES)
        app.add_routes([web.post(p, self._handle) for p in (MUTATE_PATH, LEGACY_MUTATE_PATH, VALIDATE_PATH)])
        runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=2.0)
        await runner.setup()
        try:
            context = await self._listen(runner)
            if context is None:
                return
            if self.manage is not None:
                await self._manage()
            await self._watch_certificate(context)
        finally:
            self._listening = False
            await runner.cleanup()

    async def _load_config(self) -> None:
        reported = ""
        while not self._stop.is_set():
            try:
                self.config = await asyncio.to_thread(self.config_source)
                return
            except Exception as exc:  # noqa: BLE001 - the apiserver may be briefly away (any client error); retried
                if api_reason(exc) != reported:
                    reported = api_reason(exc)
                    log.warning("admission: cannot tell the sidecar mode yet (%s); trying again", reported)
            await self._pause(RETRY_SECONDS)

    def _context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.certfile, self.keyfile)
        return context

    async def _listen(self, runner: web.AppRunner) -> ssl.SSLContext | None:
        """Bind the port with the certificate; try again until it works or the server stops."""
        reported = ""
        while not self._stop.is_set():
            try:
                context = self._context()
                await web.TCPSite(runner, self.address, self.port, ssl_context=context, reuse_address=True).start()
            except (OSError, ssl.SSLError) as exc:
                if str(exc) != reported:
                    reported = str(exc)
                    log.warning(
                        "admission: cannot serve on %s:%d yet: %s; trying again every %g s",
                        self.address,
                        self.port,
                        exc,
                        RETRY_SECONDS,
                    )
                await self._pause(RETRY_SECONDS)
                continue
            self._listening = True
            log.info(
                "admission webhooks served on https://%s:%d (%s, %s)",
                self.address,
                self.port,
                MUTATE_PATH,
                VALIDATE_PATH,
            )
            return context
        return None

    async def _manage(self) -> None:
        assert self.manage is not None
        delay = RETRY_SECONDS
        while not self._stop.is_set():
            try:
                await asyncio.to_thread(self.manage)
                return
            except Exception as exc:  # noqa: BLE001 - any client or API error while registering is retried
                log.warning("admission: cannot register the webhook configurations: %s; trying again", api_reason(exc))
            await self._pause(delay)
            delay = min(30.0, delay * 2)

    async def _watch_certificate(self, context: ssl.SSLContext) -> None:
        """Load the certificate again when its files change: new connections get the new one."""
        paths = (self.certfile, self.keyfile)
        seen = _files_signature(paths)
        while not self._stop.is_set():
            await self._pause(RELOAD_SECONDS)
            now = _files_signature(paths)
            if now is None or now == seen:
                continue
            try:
                self._context()  # the pair must load as a pair before the live context takes it
                context.load_cert_chain(self.certfile, self.keyfile)
            except (OSError, ssl.SSLError) as exc:  # half written: the next look tries again
                log.warning("admission: the new certificate does not load yet: %s", exc)
                continue
            seen = now
            log.info("admission: loaded the renewed certificate %s", self.certfile)

    async def _handle(self, request: web.Request) -> web.Response:
        try:
            review = await request.json(loads=json.loads)
        except ValueError:
            return web.json_response({"error": "the body is not JSON"}, status=400)
        status, body = review_response(request.path, review, self.config, self.namespaces)
        return web.json_response(body, status=status)


def manage_configurations(api_client: Any, name: str, base_url: str, ca_bundle: bytes) -> None:
    """Create or replace the webhook configurations ``name`` (``--webhook-manage``; every replica writes the same)."""
    from kubernetes import client

    api = client.AdmissionregistrationV1Api(api_client)
    mutating, validating = webhook_configurations(name, base_url, ca_bundle)
    pairs = (
        (
            mutating,
            api.read_mutating_webhook_configuration,
            api.create_mutating_webhook_configuration,
            api.replace_mutating_webhook_configuration,
        ),
        (
            validating,
            api.read_validating_webhook_configuration,
            api.create_validating_webhook_configuration,
            api.replace_validating_webhook_configuration,
        ),
    )
    for body, read, create, replace in pairs:
        try:
            current = read(name)
        except Exception as exc:  # noqa: BLE001 - any client's error, known by its status; the rest raised
            if api_status(exc) != 404:
                raise
            create(body)
            continue
        body = {**body, "metadata": {**body["metadata"], "resourceVersion": current.metadata.resource_version}}
        replace(name, body)
    log.info("registered the webhook configurations %s for %s", name, base_url)
