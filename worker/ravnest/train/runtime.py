"""One provider's training loop: it routes the frames its node receives to the parts that act on
them, and the cluster's root also drives it by reading batches and feeding microbatches forward.
Frames come and go by its `Routes` (`routing`); the members of its rings in other clusters come
and go by its `Members` (`members`: join, leave, a newcomer's introduction, and its own rejoin);
what it may do outside its pipeline (welcome a newcomer, introduce itself, drain when told) it is
given when it is made (`Outside`).

- forward frames go downstream with the activations every later stage needs (skip connections
  included) and the labels; the leaf computes the loss and starts the backward pass at once
  (`pipelining`);
- backward frames go upstream with the gradients of the stage's inputs and the leaf's loss;
- every node steps its optimizer after `updateFrequency x microbatches` backward passes
  (`optimizing`);
- the root feeds `sync` (a flush per optimizer step: equals single-process training) or `async`
  (weight stashing), see `schedules`;
- at every `reduceFactor`-th update the root drains the pipeline, then each node averages its
  parameters and buffers with the nodes of the other clusters that own the same ones
  (`averaging`, `allreducing`);
- validation (`validating`, `curves`), checkpoints (`resuming`) and the end of training travel
  down the pipeline as control frames (`messages`) at drained points, so every node acts on the
  same weights;
- a node of a cluster restarted alone (elastic training) takes its state from the other clusters
  and comes back into the rings at a round boundary (`rejoin`, `rejoining`, `members`), and the
  other clusters' nodes answer it between their rounds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ravnest.comm.framing import Frame
from ravnest.comm.inboxes import Inbox
from ravnest.comm.sending import RingSender, Sender
from ravnest.errors import PeerFailed, RavnestError, shown
from ravnest.plan.partitioning import OUTPUT, Stage
from ravnest.plan.plans import NodePlan, Plan, as_planned
from ravnest.train.allreducing import FINAL_ROUND, RingReducer, reduce_all
from ravnest.train.averaging import RingTensors, ring_reducers, ring_tensors
from ravnest.train.curves import Curve, LossMeter
from ravnest.train.heap import HeapTrimmer
from ravnest.train.members import Members, Outside, Parts
from ravnest.train.messages import (
    LABELS,
    Abort,
    BadControl,
    Check,
    Checked,
    Checkpoint,
    Control,
    EpochEnd,
    EvalEnd,
    FinalReduce,
    Finish,
    Here,
    Join,
    Kind,
    Late,
    Leave,
    Leaving,
    Op,
    Reduce,
    Rejoin,
    State,
    Step,
    ValResult,
    Where,
    parse,
)
from ravnest.train.metrics import WorkerMetrics
from ravnest.train.optimizing import Optimization
from ravnest.train.outer import OuterStep, outer_steps
from ravnest.train.pipelining import Pending, StagePasses
from ravnest.train.rejoining import (
    RingMembership,
    join_round,
)
from ravnest.train.resuming import Checkpoints
from ravnest.train.routing import Routes
from ravnest.train.scaling import OVERFLOW, SCALE, SKIP
from ravnest.train.schedules import WeightStash, drains
from ravnest.train.settings import Settings
from ravnest.train.targets import MetricError, Targets, split
from ravnest.train.validating import Validation

log = logging.getLogger(__name__)


Batch = tuple[tuple[torch.Tensor, ...], Any]
"""A batch's inputs and what goes with them to the leaf: a job's labels tensor, None in the seed
API (whose leaf reads its own labels), or a one-node cluster's own batch."""


@dataclass
class Batches:
    """The root's data: one cluster's shard of the training set, and the validation set."""

    train: Callable[[int], Iterator[Batch]]
    """epoch -> this cluster's (inputs, labels) batches of that epoch, in order."""
    per_epoch: int
    """Batches used per epoch (extra ones are not used). When it is not a multiple of
    updateFrequency, the epoch's last update steps over the batches it has."""
    validation: Callable[[], Iterator[Batch]]


OUTSIDE = frozenset({Op.WHERE, Op.HERE, Op.JOIN, Op.STATE, Op.LATE, Op.LEAVING})
"""The operations a node gets from outside its pipeline: from the members of its rings in other
clusters (restarted ones, drained ones, new ones), which it does not trust to be well formed."""


class NodeRuntime:
    """The training loop of one node."""

    rejoined: dict[str, Any] | None
    """How this node rejoined a running job (round, updates, seconds, bytes, from), if it did."""
    outer: dict[str, OuterStep]
    """The outer step of each of this node's rings (training.outer), by ring id."""

    def __init__(self, name: str, plan: Plan, stage: Stage, settings: Settings,
                 optimizer: torch.optim.Optimizer | None, scheduler: Any,
                 criterion: Callable[..., torch.Tensor] | None, inbox: Inbox,
                 peers: Mapping[str, Sender], metrics: WorkerMetrics,
                 batches: Batches | None = None,
                 ring_peers: Mapping[str, RingSender] | None = None,
                 reducers: Sequence[RingReducer] | None = None,
                 targets: Targets | None = None,
                 membership: RingMembership | None = None, *,
                 outside: Outside | None = None, routes: Routes | None = None) -> None:
        """`peers`: links to the pipeline neighbours (and, without `ring_peers`, to the other
        ring members), by node name. `ring_peers`: the other ring members' data-plane links
        (training.ringTransport: tcp). `reducers`: one per ring of this node in the plan;
        without them, `averaging.ring_reducers` over `ring_peers` or else `peers`, whose rounds
        go on without the members `membership` says are absent. `targets`: where a leaf's
        criterion gets its targets (default: the labels the root sends). `outside`: its ways to
        the world outside its pipeline; `routes`: its frames' (default: `peers` and `inbox`)."""
        self.name = name
        self.me: NodePlan = plan.node(name)
        self.stage, self.s, self.batches = stage, settings, batches
        self.inbox, self.peers, self.metrics = inbox, peers, metrics
        self.routes = routes if routes is not None else Routes(name, plan, peers, inbox, metrics,
                                                               settings.peer_timeout)
        params = dict(stage.named_parameters())
        self.stash = WeightStash(params, settings.schedule == "async")
        self.passes = StagePasses(name, stage, self.me.is_root, criterion, self.stash,
                                  settings.batch_size * settings.update_frequency, metrics,
                                  targets, settings.placement, settings.loss_as_given)
        self.optimization = Optimization(optimizer, scheduler, list(params.values()), settings,
                                         metrics)
        self.reducers = self._with_tensors(plan, reducers if reducers is not None else
                                           ring_reducers(plan, name, ring_peers or peers, inbox,
                                                         settings, lost=membership.absent
                                                         if membership is not None else None))
        self.rounds_skipped = self.rounds_partial = 0
        self.rejoined = None
        outside = outside if outside is not None else Outside()
        self._drain_asked = outside.drain_asked  # (None once it said yes)
        metrics.clusters_active.set(len(plan.clusters))
        self.validation = Validation(criterion, settings.metric, settings.validation_smoothing,
                                     metrics)
        self.val_result: ValResult | None = None
        self.curve = Curve()
        self.losses = LossMeter()
        self.best_state: dict[str, torch.Tensor] | None = None
        self._snapshot: dict[str, torch.Tensor] | None = None
        self.checkpoints = Checkpoints(settings, name, as_planned(plan).names(), metrics,
                                       plan.fingerprint)  # (added clusters write none)
        self.members = Members(name, plan, settings, Parts(
            stage, self.optimization, self.reducers, self.checkpoints, self.routes, self.handle,
            self._parse, self.outer), membership, outside)
        self.updates = self.epoch = self.next_batch = self.samples = self.in_flight = 0
        self._finished = self._overflowed = False  # (overflowed: its next forward says so)
        # fp16, sync: a stage holds its update's step until the root's Step says (`scaling`)
        self._commits = (settings.precision == "fp16" and settings.schedule == "sync"
                         and not (self.me.is_root and self.me.is_leaf))
        self._held = False
        self._checked: bool | None = None  # (at a root: its Check answered)
        self._last_step_time = time.monotonic()
        self._trim_heap = HeapTrimmer()

    def _with_tensors(self, plan: Plan, reducers: Sequence[RingReducer]
                      ) -> list[tuple[RingReducer, RingTensors]]:
        """Each reducer with the tensors its ring averages here (and its outer step made)."""
        want = sorted(r.id for r in plan.rings_of(self.name))
        got = sorted(r.ring.id for r in reducers)
        if got != want:
            raise RavnestError(f"{self.name}: reducers for rings {got}, but the plan puts this "
                               f"node in rings {want}")
        averaged = self.optimization if self.s.average_optimizer else None
        self.outer = outer_steps(self.s.outer, self.stage,
                                 [(r.id, r.state) for r in plan.rings_of(self.name)])
        return [(r, ring_tensors(self.stage, r.ring.state, averaged, self.outer.get(r.ring.id)))
                for r in reducers]

    @property
    def plan(self) -> Plan:
        """This node's plan, with the nodes of clusters added to the running job that
        introduced themselves (`Members.welcome`)."""
        return self.members.plan

    @property
    def leave_after(self) -> int | None:
        """The round after which this node's cluster leaves the job (it drains), once known."""
        return self.members.leave_after

    @property
    def final_clusters(self) -> set[int] | None:
        """The clusters whose nodes this node's final round held, or that it sent the final
        state to (`Members.final_clusters`)."""
        return self.members.final_clusters

    @property
    def pending(self) -> dict[int, Pending]:
        """The microbatches between their forward and their backward here."""
        return self.passes.pending

    @property
    def _stash(self) -> dict[str, torch.Tensor] | None:
        """The weight stash forwards run on now (bench/pipeline.py's memory sampler reads it)."""
        return self.stash.current

    # ----------------------------------------------------------------------------- state

    def state(self) -> dict[str, Any]:
        """Everything needed to resume this node."""
        return {
            "stage": self.stage.stage_state_dict(), **self.optimization.state(),
            "updates": self.updates, "epoch": self.epoch, "next_batch": self.next_batch,
            "samples": self.samples, "rng": torch.get_rng_state(),
            "curve": self.curve.state(), "best": self.best_state,
            **({"loss_scale": self.passes.loss_scale.state()} if self.passes.loss_scale else {}),
            **({"outer": {r: o.tensors() for r, o in self.outer.items()}} if self.outer else {}),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.stage.graph_module.load_state_dict(state["stage"])
        self.optimization.load(state)
        self.updates, self.epoch = state["updates"], state["epoch"]
        self.next_batch, self.samples = state["next_batch"], state["samples"]
        torch.set_rng_state(state["rng"])
        self.curve = Curve(**state["curve"])
        self.best_state = state["best"]
        if self.passes.loss_scale is not None:
            self.passes.loss_scale.load(state.get("loss_scale"))
        outer = state.get("outer") or {}
        for ring_id, step in self.outer.items():
            if ring_id in outer:
                step.load(outer[ring_id], f"{self.name}'s checkpoint")
            else:  # (a checkpoint of a job that had no outer optimizer)
                step.anchor()
        self.metrics.step.set(self.updates)

    def resume(self) -> int | None:
        """Load the newest checkpoint complete for every node, if any; return its step."""
        newest = self.checkpoints.newest()
        if newest is None:
            return None
        step, state = newest
        self.load_state(state)
        log.info("%s resumed from checkpoint at step %d (epoch %d, batch %d)", self.name, step,
                 self.epoch, self.next_batch)
        return step

    # ----------------------------------------------------------------------------- frames

    @property
    def up(self) -> Sender | None:
        """The link to the pipeline's previous stage (None at a root)."""
        return self.routes.up

    @property
    def down(self) -> Sender | None:
        """The link to the pipeline's next stage (None at a leaf)."""
        return self.routes.down

    def handle(self, frame: Frame) -> None:
        if frame.kind == Kind.CONTROL:
            c = self._parse(frame)
            if isinstance(c, Abort):
                raise PeerFailed(c.node, c.error, via=frame.sender)
            if c is not None:
                self._control(c)
            return
        if frame.kind == Kind.FORWARD:
            self._forward(frame.microbatch, frame.tensors, frame.control)
        elif frame.kind == Kind.BACKWARD:
            self._backward(frame.microbatch, frame.tensors, frame.control)
        elif frame.kind == Kind.EVAL:
            self._eval_forward(frame.tensors, frame.control)
        else:
            raise RavnestError(f"{self.name}: unexpected frame kind {frame.kind!r}")

    # ----------------------------------------------------------------------------- compute

    def _forward(self, mb: int, tensors: dict[str, torch.Tensor], control: dict[str, Any]) -> None:
        self.passes.forward(mb, tensors, control)
        if self.me.is_leaf:
            if control.get(OVERFLOW) and self.passes.loss_scale is not None:
                self.passes.loss_scale.told = True
            in_grads, info = self.passes.leaf_backward(mb)
            self._backward_done(mb, in_grads, info)
        else:
            if self._overflowed:  # (the leaf halves its loss scale)
                control, self._overflowed = {**control, OVERFLOW: True}, False
            self.routes.send_down(self._outgoing(Kind.FORWARD, self.passes.downstream(mb),
                                                 control, mb))

    def _backward(self, mb: int, grads: dict[str, torch.Tensor], control: dict[str, Any]) -> None:
        self._backward_done(mb, self.passes.backward(mb, grads), control)

    def _backward_done(self, mb: int, in_grads: dict[str, torch.Tensor],
                       control: dict[str, Any]) -> None:
        """Microbatch `mb`'s backward ran here: the root counts it back in, the others send the
        gradients of their inputs up; an update's last backward steps the optimizer."""
        last = self.optimization.accumulated(int(control.get("n", 0)),
                                             int(control.get("per_update", 0)),
                                             control.get(SCALE))
        # fp16: an update that overflowed after this stage (its last backward says so) or here
        # is skipped here too, and the stages before it are told so the same way
        skip = last and (bool(control.get(SKIP)) or not self.optimization.check())
        if self.me.is_root:
            self.in_flight -= 1
            self.metrics.in_flight.set(self.in_flight)
            self.losses.add(control.get("loss", 0.0), control.get("n", 0))
        else:  # (SKIP comes only with an update's last backward, and then `skip` holds it)
            if skip and not control.get(SKIP):
                control = {**control, SKIP: True}
            self.routes.send_up(self._outgoing(Kind.BACKWARD, in_grads, control, mb))
        if not last:
            return
        if not self._commits:
            self._optimizer_step(skip)
            return
        self._held = True
        if self.me.is_root:  # the whole update's outcome, which every stage takes
            self._control(Step(skip=skip))

    def _outgoing(self, kind: str, tensors: dict[str, torch.Tensor], control: dict[str, Any],
                  mb: int = 0) -> Frame:
        """A frame of this stage's `tensors` and `control` as it leaves: in host memory, copied
        there off this thread on a CUDA device (`Placement.outgoing`)."""
        host, control, ready = self.passes.placement.outgoing(tensors, control)
        return Frame(kind, host, microbatch=mb, control=control, ready=ready)

    def _optimizer_step(self, skip: bool = False) -> None:
        finite = self.optimization.step(skip)
        if self.passes.loss_scale is not None:
            self.passes.loss_scale.update(not finite)
        elif not self.optimization.own_finite and not self._commits:
            self._overflowed = True  # (an overflow began here: the leaf is told, and backs off)
        if not finite:
            log.info("%s: update %d skipped: its fp16 gradients overflowed", self.name,
                     self.updates + 1)
        self.stash.drop()
        self.updates += 1
        now = time.monotonic()
        self.metrics.step_seconds.observe(now - self._last_step_time)
        self._last_step_time = now
        self.metrics.steps.inc()
        self.metrics.step.set(self.updates)
        if self.passes.placement.device.type == "cuda":  # (no wait: the allocator's count)
            self.metrics.device_peak.set(torch.cuda.max_memory_allocated(
                self.passes.placement.device))
        self._trim_heap()
        if self.updates % self.s.reduce_factor == 0:
            self.all_reduce(self.updates // self.s.reduce_factor)

    def all_reduce(self, round_: int) -> None:
        if not self.reducers or (self.leave_after is not None and round_ > self.leave_after):
            return  # (a draining cluster takes part in no round after its leave round)
        t0 = time.perf_counter()
        with self.metrics.timed("communication"):
            rounds = reduce_all(self.reducers, round_,
                                lambda r, done: self._settle(r, done, round_ == FINAL_ROUND))
        self.stash.drop()
        self.metrics.allreduce_seconds.observe(time.perf_counter() - t0)
        self.metrics.reduce_rounds.inc(rounds.done)
        self.metrics.reduce_skipped.inc(rounds.skipped)
        self.metrics.reduce_partial.inc(rounds.partial)
        self.metrics.ring_missing.set(rounds.missing)
        present = {self.plan.node(m).cluster for r, _ in self.reducers for m in r.members}
        self.metrics.clusters_active.set(len(present))
        self.rounds_skipped += rounds.skipped
        self.rounds_partial += rounds.partial
        self.members.round_done(round_, present, self.updates)

    def _settle(self, reducer: RingReducer, done: bool, final: bool) -> None:
        """A ring's round is over: with an outer optimizer, step it (or drop the round)."""
        outer = self.outer.get(reducer.ring.id)
        if outer is None:
            return
        if not done:
            outer.dropped()
            return
        with self.metrics.timed("compute"):
            outer.step(final)

    @torch.no_grad()
    def _eval_forward(self, tensors: dict[str, Any], control: dict[str, Any]) -> None:
        labels = tensors.pop(LABELS, None)
        out = self.passes.evaluate(tensors)
        if not self.me.is_leaf:
            send = dict(out)
            if labels is not None:
                send[LABELS] = labels
            self.routes.send_down(self._outgoing(Kind.EVAL, send, control))
            return
        try:
            targets = self.passes.placement.put(self.passes.targets.validation(control, labels))
        except (MetricError, RavnestError) as e:
            self.validation.fail("loss", e)
            self.validation.fail("accuracy", e)
            return
        self.validation.add(out[OUTPUT], targets, control.get("n"))

    # ----------------------------------------------------------------------------- control

    def _parse(self, frame: Frame) -> Control | None:
        """The payload of a control frame (`messages.parse`). One that is none: from outside the
        pipeline (a ring member of another cluster's, `OUTSIDE`), logged and dropped (None), as
        any control not for this node is; from the pipeline, BadControl."""
        try:
            c = parse(frame.control)
        except BadControl as e:
            if frame.control.get("op") not in OUTSIDE:
                raise BadControl(f"{self.name}: from {frame.sender or 'its pipeline'}: {e}"
                                 ) from None
            log.warning("%s: from %s: %s; dropped", self.name, frame.sender, e)
            return None
        if isinstance(c, Where | Join | Leaving) and c.node != frame.sender:
            # a node speaks for itself only (its frames' sender is its connection's, with TLS)
            log.warning("%s: a %s for %s sent by %s, dropped: a node speaks for itself only",
                        self.name, c.op, shown(c.node), shown(frame.sender))
            return None
        return c

    def _control(self, c: Control) -> None:
        """Act on a control (from upstream, the leaf's validation result, or the root's own) and
        pass it on: down the pipeline, or a validation result up to the root."""
        match c:
            case EvalEnd():
                self._snapshot = {k: v.detach().to("cpu", copy=True)  # (host memory)
                                  for k, v in self.stage.stage_state_dict().items()}
                if self.me.is_leaf:
                    self._control(self.validation.finish(self.curve, c.epoch, c.step))
                else:
                    self.routes.control_down(c)
            case ValResult():
                if c.best:
                    self.best_state = self._snapshot
                if self.me.is_root:
                    self.val_result = c
                else:
                    self.routes.send_up(Frame(Kind.CONTROL, control=c.wire()))
            case EpochEnd():
                self.epoch = c.epoch + 1
                self.optimization.epoch_end(c.val_loss)
                self.routes.control_down(c)
            case Checkpoint():
                self.routes.control_down(c)
                self._checkpoint(c)
            case Step() | Check() | Checked():
                self._stepping(c)
            case Reduce():
                self.routes.control_down(c)
                self.all_reduce(c.round)
            case FinalReduce():
                self.routes.control_down(c)
                self.all_reduce(FINAL_ROUND)
            case Finish():
                self.routes.control_down(c)
                self._finished = True
            case Where():
                self.members.where(c, self.updates)
            case Join():
                self.members.join(c)
            case Leave():
                self.routes.control_down(c)
                self.members.leave(c.round)
            case Leaving():
                self.members.leaving(c)
            case Here() | State() | Late():
                log.info("%s: a late %s from a restarted node's exchange, dropped", self.name,
                         c.op)
            case _:
                raise RavnestError(f"{self.name}: unexpected control {c.op!r}")

    def _stepping(self, c: Step | Check | Checked) -> None:
        """Step an update: an epoch's short last one, or (fp16, sync) a held one as the root
        says; and the question whether a short one's gradients are finite, and its answer."""
        match c:
            case Step():
                if (c.skip is None and self._commits and self.me.is_root
                        and self.optimization.pending()):
                    c = Step(skip=self._check_all())
                self.routes.control_down(c)
                if self._held or self.optimization.pending():
                    self._held = False
                    self._optimizer_step(bool(c.skip))
            case Check():
                if self.me.is_leaf:
                    self._stepping(Checked(skip=False))
                else:
                    self.routes.control_down(c)
            case Checked():  # (this stage's answer with those of the stages after it)
                skip = c.skip or (self.optimization.pending() and not self.optimization.check())
                if self.me.is_root:
                    self._checked = skip
                else:
                    self.routes.send_up(Frame(Kind.CONTROL, control=Checked(skip=skip).wire()))

    def _check_all(self) -> bool:
        """At a root, in fp16 (sync), before an epoch's short last update steps: whether any
        stage's gradients overflowed (asked down the pipeline, answered up it)."""
        self._checked = None
        self.routes.control_down(Check())
        self._wait_until(lambda: self._checked is not None)
        return bool(self._checked)

    # ----------------------------------------------------------------------------- rejoining

    def rejoin(self) -> dict[str, Any]:
        """Bring this node of a restarted cluster back: agree on the join round along the
        pipeline (the root picks it), ask the members of its rings to take it in after that
        round, and load the state they send then (`rejoining`, `Members`). Returns how it
        went."""
        if self.s.reduce_each_epoch:
            raise RavnestError(f"{self.name}: a cluster can only rejoin a job that averages "
                               f"every reduceFactor updates")
        started = time.monotonic()
        if self.me.is_root:
            assert self.batches is not None
            c = self.members.choose_join(self.batches.per_epoch)
        else:
            got, _ = self.members.await_controls((Op.REJOIN,), self.s.peer_timeout)
            assert isinstance(got, Rejoin)
            c = got
        self.routes.control_down(c)
        updates, nbytes, sources = self.members.take_states(c)
        self.updates, self.epoch, self.next_batch = updates, c.epoch, c.next_batch
        if c.final:
            self.epoch = self.s.epochs
        self.stash.drop()
        self.metrics.step.set(self.updates)
        seconds = time.monotonic() - started
        self.metrics.recoveries.inc()
        self.metrics.recovery_seconds.set(seconds)
        self.metrics.recovery_bytes.inc(nbytes)
        self.rejoined = {"round": c.round, "updates": updates, "seconds": round(seconds, 3),
                         "bytes": nbytes, "from": sources}
        log.warning("%s rejoined after round %s at update %d: %d bytes of state from %s in "
                    "%.2f s (its data resumes at epoch %d, batch %d)", self.name,
                    "final" if c.round is None else c.round, updates, nbytes,
                    ", ".join(sources) or "nobody (no parameters shared)",
                    seconds, self.epoch, self.next_batch)
        return self.rejoined

    def _checkpoint(self, c: Checkpoint) -> None:
        if not self.checkpoints.directory or self.plan.grown(self.me.cluster):
            return  # (a cluster added to the running job has no checkpoint: it joins again)
        self.next_batch, self.epoch = c.next_batch, c.epoch
        self.checkpoints.save(c.step, self.state())

    # ----------------------------------------------------------------------------- loops

    def serve(self) -> None:
        """Loop of a non-root node: handle frames until the root says training is over."""
        self.metrics.start_loop()
        while not self._finished:
            self.handle(self.routes.next_frame())
        self.routes.flush()

    def _wait_until(self, done: Callable[[], bool]) -> None:
        while not done():
            self.handle(self.routes.next_frame())

    def _feed(self, inputs: tuple[torch.Tensor, ...], labels: Any, mb: int,
              control: dict[str, Any]) -> None:
        self._wait_until(lambda: self.in_flight < self.s.max_in_flight)
        tensors: dict[str, Any] = dict(zip(self.stage.input_names, inputs, strict=True))
        if labels is not None:
            tensors[LABELS] = labels
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)
        self._forward(mb, tensors, control)

    def drive(self, on_update: Callable[[NodeRuntime], None] | None = None,
              on_epoch: Callable[[NodeRuntime, int], None] | None = None) -> None:
        """Loop of a cluster's root: feed every batch, validate, checkpoint, finish.
        `on_update` runs at every drained update, `on_epoch` after each epoch's validation."""
        assert self.batches is not None
        self.metrics.start_loop()
        s, b = self.s, self.batches
        updates_per_epoch = -(-b.per_epoch // s.update_frequency)
        self.metrics.total_steps.set(s.epochs * updates_per_epoch)
        mb_id = (self.epoch * b.per_epoch + self.next_batch) * s.microbatches
        while self.epoch < s.epochs:
            epoch = self.epoch
            self.metrics.epoch.set(epoch)
            for batch, (inputs, labels) in enumerate(b.train(epoch)):
                if batch >= b.per_epoch:
                    break
                if batch < self.next_batch:
                    continue
                self._feed_batch(inputs, labels, mb_id, epoch, batch)
                mb_id += s.microbatches
                if (batch + 1) % s.update_frequency:
                    continue
                # the update this batch completes, counted from what was fed
                update = epoch * updates_per_epoch + (batch + 1) // s.update_frequency
                if not drains(s, update, bool(self.plan.rings), batch + 1 == b.per_epoch):
                    continue
                self._wait_until(lambda: self.in_flight == 0)
                self._record_loss()
                if s.checkpoint_every and self.updates % s.checkpoint_every == 0:
                    self._send_checkpoint(epoch, batch + 1)
                if on_update is not None:
                    on_update(self)
                self._drain_if_told()
                if self._left():
                    break
            if self._left():
                break
            self._end_epoch(epoch, on_epoch)
        self._control(Finish())
        self.routes.flush()

    def _left(self) -> bool:
        """Whether this node's cluster drains and is past its leave round."""
        return self.leave_after is not None and self.updates >= (
            self.leave_after * self.s.reduce_factor)

    def _drain_if_told(self) -> None:
        """At a root, at a drained update: start draining if told to (the leave round picked as
        a join round is, `rejoining`)."""
        if self.leave_after is None and self._drain_asked is not None and self._drain_asked():
            assert self.batches is not None
            self._drain_asked = None  # asked once
            rounds = self.members.rounds
            round_ = join_round(rounds.last, rounds.seconds or 1.0,
                                self.members.last_round_of_job(self.batches.per_epoch))
            if round_ is None or self.s.reduce_each_epoch or not self.plan.rings:
                log.warning("%s: told to drain, but its cluster finishes with the others (the "
                            "job's last round is too near, or it averages only each epoch)",
                            self.name)
            else:
                self._control(Leave(round=round_))

    def _end_epoch(self, epoch: int,
                   on_epoch: Callable[[NodeRuntime, int], None] | None) -> None:
        """Once the epoch's batches are back: step a short last update, average (each epoch in
        the seed API without reduce_factor; always after the last), validate, checkpoint."""
        s = self.s
        last = epoch + 1 == s.epochs
        self._wait_until(lambda: self.in_flight == 0)
        self._control(Step())
        self._record_loss()
        if last:
            self._control(FinalReduce())
        elif s.reduce_each_epoch and self.plan.rings:
            self._control(Reduce(round=epoch + 1))
        val_loss = None
        if (epoch + 1) % s.validation_frequency == 0 or last:
            self._validate(epoch)
            assert self.val_result is not None
            val_loss = self.val_result.val_loss
        self._control(EpochEnd(epoch=epoch, val_loss=val_loss))
        self.next_batch = 0
        if not s.checkpoint_every or last:
            self._send_checkpoint(epoch + 1, 0)
        if on_epoch is not None:
            on_epoch(self, epoch)

    def _feed_batch(self, inputs: tuple[torch.Tensor, ...], labels: Any, first_mb: int,
                    epoch: int, batch: int) -> None:
        """Feed a batch of any size as up to `microbatches` microbatches (fewer when it has
        fewer samples), each naming its place for the leaf (`targets`)."""
        n = int(inputs[0].shape[0])
        pieces = [x.tensor_split(self.s.microbatches) for x in inputs]
        sizes = [int(p.shape[0]) for p in pieces[0] if p.shape[0]]
        parts = split(labels, sizes) if labels is not None else [None] * len(sizes)
        for m in range(len(sizes)):
            control = {"epoch": epoch, "batch": batch, "part": m, "sizes": sizes}
            self._feed(tuple(p[m] for p in pieces), parts[m], first_mb + m, control)
        self.samples += n
        self.metrics.samples.inc(n)

    def _record_loss(self) -> None:
        loss = self.losses.take()
        if loss is None:
            return
        self.metrics.loss.set(loss)
        self.curve.add_training(loss, self.epoch, self.updates, self.samples)

    def _send_checkpoint(self, epoch: int, next_batch: int) -> None:
        if self.s.checkpoint_dir:
            self._control(Checkpoint(step=self.updates, epoch=epoch, next_batch=next_batch))

    def _validate(self, epoch: int) -> None:
        assert self.batches is not None
        self.val_result = None
        for batch, (inputs, labels) in enumerate(self.batches.validation()):
            tensors: dict[str, Any] = dict(zip(self.stage.input_names, inputs, strict=True))
            if labels is not None:
                tensors[LABELS] = labels
            # one validation per epoch at most: the epoch names it for a seed leaf's test_labels
            self._eval_forward(tensors, {"validation": epoch, "batch": batch,
                                         "n": int(inputs[0].shape[0])})
        self._control(EvalEnd(epoch=epoch, step=self.updates))
        self._wait_until(lambda: self.val_result is not None)
        r = self.val_result
        assert r is not None
        self.curve.add_validation(r, epoch, self.updates, self.samples)
        self.metrics.val_loss.set(r.val_loss)
        if r.val_error:
            log.warning("%s: validation after epoch %d: %s", self.name, epoch, r.val_error)
        if r.val_metric is not None:
            self.metrics.val_metric.set(r.val_metric)
