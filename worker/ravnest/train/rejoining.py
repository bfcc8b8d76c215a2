"""Rejoining: a cluster that was lost and restarted (elastic training: the local runner or the
operator restarts only that cluster) takes its stages' current state from the nodes that hold the
same parameters in the other clusters, not from a checkpoint, and comes back into the rings at a
round boundary, while the other clusters go on training.

The exchange, in control frames on the nodes' authenticated links (tensors framed as any frame's,
no pickle):

1. the restarted root asks a member of one of its rings where training is (`where`; the answer,
   `here`, gives the member's last round and the seconds a round takes there) and picks the
   *join round* R: the first round at least `JOIN_MARGIN_SECONDS` ahead, so that every node of the
   cluster can ask before the others get there, and as many seconds more as the answer took to
   come (it is that old; past the last round: the final one);
2. it sends `rejoin` (R, and where its data resumes) down its pipeline, and every node of the
   cluster passes it on and sends `join` (R) to the other members of each of its rings: from
   round R + 1 they take it in again (`RingMembership.admit`), and one member of each ring, the
   first present in the plan's order, sends it that ring's `state` once its round R is over: the
   parameters and buffers the ring averages, their optimizer state, the scheduler's state and the
   update count (a member past R already answers `late`: the node fails and its cluster is
   restarted again);
3. each node loads what it got and trains on from update R x reduceFactor.

The data schedule stays the one `worker.cluster_batches` documents (batch b of epoch e is the same
samples for a cluster however often it is restarted): the restarted cluster's root resumes at the
batch of update R x reduceFactor, so its shard's batches from the update it had last completed up
to that one are skipped, for that epoch only. A ring member that a watch lost and that answers
again without having restarted (a network cut healed) is taken in again from the next round.

Draining is the way out (issue 20, grow and shrink: a provider removed from a running job). The
root of a cluster told to drain (`ravnest drain`: a non-empty file `cluster_<c>` in the folder
that `run.metadata.DRAIN_DIR_ENV` names) picks its *leave round* L as a restarted root picks its
join round, from its own clock, and sends `leave` (L) down its pipeline; every node of the
cluster sends `leaving` (L) to the other members of each of its rings, which go without it from
round L + 1 on (`RingMembership.leave`) and do not take its exit for a loss. The cluster trains
up to round L, then stops: it writes no stage and no figures (the job's model is the others'),
and its root acknowledges with `cluster_<c>.done` in that folder. Its shard of the data is not
trained from then on; the other clusters keep their own shards. Asked so late that L would be
past the job's last round, the cluster finishes with the others.

Growing is the way in (issue 20, grow: providers added to a running job, `plan.growth`). The nodes
of a cluster added to the job are not in the plan the others hold: their `where` and `join`
carry an introduction (`NEWCOMER`: the node's plan, its addresses and its rings), which the
member asked checks (`newcomer_plan`) and takes into its plan (`Plan.joined`); it links to the
newcomer and watches it, and keeps it out of the rounds until it joins. The cluster then joins as
a restarted one does, and every member's reducer of a ring it joins takes the grown ring from
the round after the join round on (`RingReducer.extend`), so that all members switch at one round.
"""

from __future__ import annotations

import json
import math
import threading
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ravnest.errors import RavnestError
from ravnest.plan.partitioning import Stage
from ravnest.plan.plans import NodePlan, Plan
from ravnest.train.messages import State
from ravnest.train.optimizing import Optimization
from ravnest.train.outer import OuterStep

JOIN_MARGIN_SECONDS = 5.0
"""How far ahead of the round the others are at a restarted cluster's join round is chosen: time
for each of its nodes to get the `rejoin` down the pipeline and ask the members of its rings."""

NEWCOMER = "newcomer"
"""The key of a `where` or `join` control in which a node of a cluster added to the running job
introduces itself (`newcomer_plan`)."""

PARAM = "p/"
OPTIM = "o/"
OUTER = "u/"
"""Prefixes of a `state` frame's tensors: a parameter or buffer, an optimizer state tensor
(``o/<parameter>/<key>``), and an outer optimizer's (``u/<parameter>/<key>``, train/outer.py)."""


class RingMembership:
    """Who a node's ring rounds go without: members a watch lost stay out until they answer again
    without having restarted (`back`: a cut healed; from the next round), or, restarted, rejoin
    (`admit`: from a given round). Thread-safe: the watch threads report, the training loop
    asks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_from: dict[str, float] = {}
        """member -> the first round it takes part in again (inf: not yet known)."""
        self._out_from: dict[str, int] = {}
        """member -> the first round it is out of for good (it drained: `leave`)."""
        self._why: dict[str, str] = {}
        """member -> why its watch took it for lost, the last time."""
        self._early: set[str] = set()
        """Members that joined while still counted in the rounds: the restarted process's `join`
        came before this node's watch saw the old process go, so the next loss the watch reports
        is the old process's, and does not undo the join (until its join round is reached; from
        then on a loss is the joined process's)."""

    def lost(self, name: str, why: str = "") -> None:
        with self._lock:
            self._why[name] = why
            if name in self._early:
                self._early.discard(name)
                return
            self._in_from[name] = math.inf

    def why(self, names: Iterable[str]) -> str:
        """Why the watch took each of `names` for lost ("" where it did not say)."""
        with self._lock:
            return "; ".join(f"{n}: {self._why[n]}" for n in sorted(names) if self._why.get(n))

    def back(self, name: str) -> None:
        with self._lock:
            self._in_from[name] = 0
            self._early.discard(name)

    def awaiting(self, name: str) -> bool:
        """Whether `name` is out of the rounds with no round known yet to take it in from (lost,
        or restarted and not joined)."""
        with self._lock:
            return self._in_from.get(name) == math.inf

    def admit(self, name: str, round_: int) -> None:
        with self._lock:
            if self._in_from.get(name, 0) == 0:
                # Still in the rounds here: its old process's loss is yet to be seen.
                self._early.add(name)
            self._in_from[name] = round_

    def leave(self, name: str, round_: int) -> None:
        """`name` drained: it takes part in no round from `round_` on, whatever its watch says."""
        with self._lock:
            self._out_from[name] = min(round_, self._out_from.get(name, round_))

    def leaving(self) -> set[str]:
        """The members that drained or are draining."""
        with self._lock:
            return set(self._out_from)

    def absent(self, round_: int) -> set[str]:
        """The members a round `round_` goes without."""
        with self._lock:
            self._early -= {n for n in self._early if self._in_from[n] <= round_}
            return {n for n, first in self._in_from.items() if first > round_} | {
                n for n, out in self._out_from.items() if out <= round_}


@dataclass
class RoundClock:
    """A node's last ring round (by updates) and the seconds a round takes there, which a
    restarted root asks to pick its join round: the fastest of the last `WINDOW` rounds, so that
    a round stalled by the loss itself does not make the join round too near."""

    WINDOW: ClassVar[int] = 16
    last: int = 0
    at: float | None = None
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RoundClock.WINDOW))

    @property
    def seconds(self) -> float | None:
        return min(self.recent) if self.recent else None

    def done(self, round_: int, now: float) -> None:
        if self.at is not None:
            self.recent.append((now - self.at) / max(1, round_ - self.last))
        self.last, self.at = round_, now


def join_round(last_round: int, seconds_per_round: float, last: int | None,
               margin: float = JOIN_MARGIN_SECONDS, waited: float = 0.0) -> int | None:
    """The join round of a restarted cluster whose ring peer completed `last_round`, a round
    taking `seconds_per_round` there: the first at least `margin` seconds ahead; None when that
    is past `last`, the job's last round by updates (the cluster then takes the final state).

    `waited`: the seconds the peer's answer took to come, which it is older by, so many seconds
    more ahead. A peer's link to a restarted node is one it had to the node's lost pod, and it
    may take seconds to connect again (gRPC's reconnect backoff, DNS that still names the old
    address); the others meanwhile trained on, and a join round picked from a stale answer was
    past when the cluster's nodes asked (`late`), so the cluster was restarted once more."""
    ahead = max(2, math.ceil((margin + max(waited, 0.0)) / max(seconds_per_round, 1e-3)))
    round_ = last_round + ahead
    return None if last is not None and round_ > last else round_


def resume_position(updates: int, per_epoch: int, update_frequency: int) -> tuple[int, int]:
    """(epoch, next batch) of a root that resumes after `updates` updates. At an epoch's end it is
    that epoch's end, not the next one's start, so that the root still closes the epoch
    (validation, a scheduler's epoch step) as the other clusters do."""
    per = -(-per_epoch // update_frequency)
    epoch, done = divmod(updates, per)
    if done == 0 and epoch > 0:
        return epoch - 1, per_epoch
    return epoch, done * update_frequency


def newcomer_plan(plan: Plan, name: str, info: Mapping[str, Any]) -> NodePlan:
    """The node plan a newcomer `name` introduced itself with (`info`: its `node` plan, its
    `address` and `rings`), checked against `plan`: a node of a cluster added to the job (the next
    one, or one added already) whose stage holds what each of its rings averages. Raises
    RavnestError saying what does not fit."""
    raw = dict(info["node"])
    node = NodePlan(**{**raw, "state": tuple(str(x) for x in raw["state"])})
    address = info.get("address")
    if node.name != name or not isinstance(address, str) or ":" not in address:
        raise RavnestError(f"the node plan names {node.name!r} and address {address!r}")
    if not plan.planned <= node.cluster <= len(plan.clusters):
        raise RavnestError(f"cluster {node.cluster} is not one added to the job (planned "
                           f"{plan.planned}, {len(plan.clusters)} now)")
    rings = {r.id: r for r in plan.rings}
    named = [str(r) for r in info.get("rings") or ()]
    if not named or any(r not in rings or not set(rings[r].state) <= set(node.state)
                        for r in named):
        raise RavnestError(f"its rings {named} are not rings of the job whose state it holds")
    return node


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def pack_state(stage: Stage, optimization: Optimization, names: tuple[str, ...],
               outer: OuterStep | None = None
               ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A ring's part of this node's state as a frame's tensors and control: the parameters and
    buffers `names`, the optimizer's state of those parameters (its non-tensor values in the
    control), the optimizer's hyperparameters and the scheduler's state, and the ring's `outer`
    state (training.outer)."""
    state = stage.stage_state_dict()
    params = dict(stage.named_parameters())
    tensors = {f"{PARAM}{n}": state[n].detach() for n in names}
    if outer is not None:
        tensors.update({f"{OUTER}{n}/{key}": t for n, kept in outer.tensors().items()
                        for key, t in kept.items()})
    scalars: dict[str, dict[str, Any]] = {}
    for n in names:
        for key, value in optimization.state_of(params.get(f"graph_module.{n}")).items():
            if isinstance(value, torch.Tensor):
                tensors[f"{OPTIM}{n}/{key}"] = value.detach()
            elif _jsonable(value):
                scalars.setdefault(n, {})[key] = value
    control: dict[str, Any] = {"scalars": scalars}
    opt = optimization.optimizer
    if opt is not None:
        control["groups"] = [{k: v for k, v in g.items() if k != "params" and _jsonable(v)}
                             for g in opt.param_groups]
    sched = optimization.scheduler
    if sched is not None:
        sd = sched.state_dict()
        control["scheduler"] = sd if _jsonable(sd) else None
    return tensors, control


def _placed(param: torch.Tensor, key: str, value: torch.Tensor) -> torch.Tensor:
    """An optimizer state tensor sent by another node, where this node's optimizer keeps it, as
    torch's `Optimizer.load_state_dict` places it: beside the parameter (its device, and its
    dtype where both are floating point), except a `step` count, which stays as it came."""
    if key == "step":
        return value.clone()
    dtype = param.dtype if param.is_floating_point() and value.is_floating_point() else None
    return value.to(device=param.device, dtype=dtype, copy=True)


def unpack_state(stage: Stage, optimization: Optimization, names: tuple[str, ...],
                 tensors: Mapping[str, torch.Tensor], control: State,
                 outer: OuterStep | None = None) -> int:
    """Load a `state` frame of a ring whose tensors are `names` into this node (and its `outer`
    state); the bytes it carried. Raises RavnestError when it does not fit this stage (another
    plan, another model, no outer state)."""
    nbytes = _unpack_outer(outer, tensors) if outer is not None else 0
    return nbytes + _unpack_inner(stage, optimization, names, tensors, control)


def _unpack_outer(outer: OuterStep, tensors: Mapping[str, torch.Tensor]) -> int:
    kept: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if key.startswith(OUTER):
            name, _, what = key.removeprefix(OUTER).rpartition("/")
            kept.setdefault(name, {})[what] = t
    return outer.load(kept, "rejoin")


def _unpack_inner(stage: Stage, optimization: Optimization, names: tuple[str, ...],
                  tensors: Mapping[str, torch.Tensor], control: State) -> int:
    state = stage.stage_state_dict(keep_vars=True)
    params = dict(stage.named_parameters())
    nbytes = 0
    with torch.no_grad():
        for n in names:
            got = tensors.get(f"{PARAM}{n}")
            mine = state.get(n)
            if got is None or mine is None or got.shape != mine.shape:
                raise RavnestError(f"rejoin: the state sent for {n} does not fit this stage "
                                   f"({None if got is None else tuple(got.shape)} vs "
                                   f"{None if mine is None else tuple(mine.shape)})")
            mine.copy_(got.to(mine.dtype))
            nbytes += got.numel() * got.element_size()
    opt = optimization.optimizer
    if opt is None:
        return nbytes
    scalars = control.scalars
    for n in names:
        p = params.get(f"graph_module.{n}")
        if p is None:
            continue
        prefix = f"{OPTIM}{n}/"
        entry: dict[str, Any] = {k.removeprefix(prefix): _placed(p, k.removeprefix(prefix), t)
                                 for k, t in tensors.items() if k.startswith(prefix)}
        entry.update(scalars.get(n) or {})
        if entry:
            opt.state[p] = entry
            nbytes += sum(t.numel() * t.element_size() for t in entry.values()
                          if isinstance(t, torch.Tensor))
    groups = control.groups or []
    for i, g in enumerate(opt.param_groups):
        hyper = groups[min(i, len(groups) - 1)] if groups else {}
        for k, v in hyper.items():
            if k in g:
                g[k] = tuple(v) if isinstance(g[k], tuple) and isinstance(v, list) else v
    sched = optimization.scheduler
    if sched is not None and control.scheduler is not None:
        sched.load_state_dict(control.scheduler)
    return nbytes
