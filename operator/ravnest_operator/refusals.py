"""When the apiserver refuses an object the operator makes for a job, pure: which answers are
refusals, and what the job's status and Event say of one.

A refusal is an answer that sending the same object again cannot change: the object is invalid
(422), malformed or too large (400, 413), or forbidden by the namespace's Pod Security level (403
with "violates PodSecurity"). The pass that got one fails the job naming the object and its fields
(`deciding.decide_refused`) instead of retrying it every few seconds for ever. Every other error
(a conflict, a quota exceeded, RBAC, a namespace being deleted, throttling, the apiserver down)
can pass, and the pass is tried again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

REFUSING = frozenset({400, 413, 422})
"""Status codes that always refuse the object as sent."""
POD_SECURITY = "violates PodSecurity"
"""What a 403 of the PodSecurity admission plugin says (a 403 is a refusal only then)."""
MESSAGE_CHARS = 1024
"""At most this much of the apiserver's message is kept (it quotes the values it refused)."""
CAUSES = 8
"""At most this many of the apiserver's causes are named."""
SOURCES = {
    "Pod": "spec.template, a provider's resources, spec.checkpoint.volume",
    "ConfigMap": "the plan",
}
"""Where the fields of each kind of object come from in the job."""


@dataclass(frozen=True)
class Refusal:
    """The apiserver refused to create (or replace) `kind` `name`."""
    kind: str
    name: str
    code: int
    reason: str
    """The Status's reason (Invalid, BadRequest, Forbidden, ...)."""
    message: str
    """The Status's message, bounded (MESSAGE_CHARS)."""
    fields: tuple[str, ...] = ()
    """The fields its causes name, in its order, each once."""

    def said(self) -> str:
        """The Failed condition's and the Event's message."""
        where = SOURCES.get(self.kind)
        fields = f" (fields: {', '.join(self.fields)})" if self.fields else ""
        source = f"; its fields come from {where}" if where else ""
        return (f"the apiserver refused {self.kind} {self.name}: {self.code} {self.reason}: "
                f"{self.message}{fields}{source}; what this pass made is deleted (its Secrets "
                f"go with the job)")


def _bounded(text: str, chars: int = MESSAGE_CHARS) -> str:
    return text if len(text) <= chars else text[:chars - 3] + "..."


def refusal(kind: str, name: str, code: int | None, reason: str | None,
            body: Any) -> Refusal | None:
    """The refusal an API error is (`body`: the answer's body, a Status as JSON), or None when it
    is not one (the pass is tried again)."""
    status: dict[str, Any] = {}
    if isinstance(body, bytes | bytearray):
        body = body.decode("utf-8", "replace")
    if isinstance(body, str):
        try:
            loaded = json.loads(body)
        except ValueError:
            loaded = None
        status = loaded if isinstance(loaded, dict) else {}
    message = status.get("message")
    message = message if isinstance(message, str) else (body if isinstance(body, str) else "")
    if code is None or (code not in REFUSING and not (code == 403 and POD_SECURITY in message)):
        return None
    details = status.get("details")
    causes = details.get("causes") if isinstance(details, dict) else None
    fields: list[str] = []
    for cause in causes if isinstance(causes, list) else []:
        named = cause.get("field") if isinstance(cause, dict) else None
        if isinstance(named, str) and named and named not in fields and len(fields) < CAUSES:
            fields.append(_bounded(named, 200))
    said = status.get("reason")
    return Refusal(kind, name, code, str(said if isinstance(said, str) and said else
                                                reason or ""),
                   _bounded(message.strip() or "(no message)"), tuple(fields))
