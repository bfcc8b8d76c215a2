"""The ravnest error hierarchy.

Errors from gRPC, torch and the file system are translated once, at the boundary where they happen,
into these classes (with the cause chained), so callers and the CLI handle one family.
"""

from __future__ import annotations

import reprlib
from typing import Any

_REPR = reprlib.Repr()
"""repr() within bounds: YAML aliases can make a 10-line document hold 10**9 list items, and
nesting can go deeper than repr() recurses."""
_REPR.maxlevel = 4
_REPR.maxtuple = _REPR.maxlist = _REPR.maxdict = _REPR.maxset = _REPR.maxfrozenset = 10
_REPR.maxstring = _REPR.maxlong = _REPR.maxother = 200


def shown(value: Any) -> str:
    """A value as an error message shows it: its repr, bounded and cut to 80 characters. Values
    come from users and peers: a job's field may hold 10**9 items, and a frame's header fields go
    back to the sender in a gRPC status, whose metadata a client refuses beyond 16 KiB."""
    try:
        text = _REPR.repr(value)
    except ValueError:
        return "an integer too large to show"
    return text if len(text) <= 80 else text[:77] + "..."


class RavnestError(Exception):
    """Base class of every error ravnest raises on purpose."""


class SpecError(RavnestError):
    """A job spec is invalid. Each problem names its field path, the value and what to do."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class PlanError(RavnestError):
    """The providers cannot hold or split the model as asked."""


class TransportError(RavnestError):
    """A peer could not be reached or refused a message."""


class PeerTimeout(TransportError):
    """A peer did not send what was expected in time."""


class PeerFailed(TransportError):
    """A provider of this node's cluster failed or vanished: this node stops too."""

    def __init__(self, node: str, error: str, via: str | None = None) -> None:
        """`node` failed with `error`; `via`: the neighbour that said so (None: `node`)."""
        self.node, self.error, self.via = node, error, via
        super().__init__(f"{node} failed: {error}")


class WorkerFailed(RavnestError):
    """A worker process of a local run failed."""
