"""Resuming: where a node saves its state at the root's checkpoint controls, and which saved
state it resumes from.

What the state holds is the runtime's (each part gives its own); the files are `checkpointing`'s.
A node saves under the root's step, then prunes to the newest `keep` steps complete for every node;
it resumes from the newest step complete and loadable for every node, so all nodes resume from the
same one. Each checkpoint records the plan's fingerprint; a folder holding another plan's
checkpoints is refused (`checkpointing.ForeignCheckpoint`), never loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ravnest.train import checkpointing
from ravnest.train.metrics import WorkerMetrics
from ravnest.train.settings import Settings


class Checkpoints:
    """One node's checkpoints (none without a checkpoint directory)."""

    def __init__(self, settings: Settings, node: str, nodes: list[str],
                 metrics: WorkerMetrics, plan: str = "") -> None:
        """`nodes`: every node of the plan; `plan`: its fingerprint."""
        self.directory = settings.checkpoint_dir
        self.keep = settings.checkpoint_keep
        self.node = node
        self.nodes = nodes
        self.plan = plan
        self._metrics = metrics
        self.guard: Callable[[], None] | None = None
        """Called before each save; raises when this run may no longer write the folder (its
        lease on it was lost: `ravnest.run.owning`)."""

    def without(self, gone: set[str]) -> None:
        """Steps are complete without the nodes `gone` (their clusters drained): they write no
        checkpoints after that, and a resume or a pruning must not wait for theirs."""
        self.nodes = [n for n in self.nodes if n not in gone]

    def save(self, step: int, state: dict[str, Any]) -> None:
        if not self.directory:
            return
        if self.guard is not None:
            self.guard()
        checkpointing.save(self.directory, step, self.node, state, self.plan)
        checkpointing.prune(self.directory, self.nodes, self.keep)
        self._metrics.checkpoint_step.set(step)

    def newest(self) -> tuple[int, dict[str, Any]] | None:
        """The newest step complete and loadable for every node, and this node's state saved at it.
        Raises `checkpointing.ForeignCheckpoint` when the folder holds another plan's."""
        if not self.directory:
            return None
        step = checkpointing.latest(self.directory, self.nodes, self.plan)
        if step is None:
            return None
        state = checkpointing.load(self.directory, step, self.node)
        self._metrics.checkpoint_step.set(step)
        return step, state
