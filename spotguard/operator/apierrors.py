"""What a kubernetes-client error says: its HTTP status and the apiserver's own message."""

from __future__ import annotations

import json
from collections.abc import Mapping


def api_status(exc: BaseException) -> int | None:
    """The HTTP status of a kubernetes-client error, if it has one."""
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) else None


def api_reason(exc: BaseException) -> str:
    """The apiserver's own message for an error (its Status ``message``), else the error."""
    body = getattr(exc, "body", None)
    if isinstance(body, bytes | str):
        try:
            doc = json.loads(body)
            if isinstance(doc, Mapping) and doc.get("message"):
                return str(doc["message"])
        except ValueError:
            pass
    return str(getattr(exc, "reason", "") or exc) or type(exc).__name__
