"""The ravnest error hierarchy.

Errors from gRPC, torch and the file system are translated once, at the boundary where they happen,
into these classes (with the cause chained), so callers and the CLI handle one family.
"""

from __future__ import annotations


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


class WorkerFailed(RavnestError):
    """A worker process of a local run failed."""
