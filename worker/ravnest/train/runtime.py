"""One provider's training loop: its stage, its optimizer, the pipeline and its rings.

Every node runs the same loop over the frames it receives; the cluster's root also drives it by
reading batches and feeding microbatches forward.

- forward frames go downstream with the activations every later stage needs (skip connections
  included) and the labels; the leaf computes the loss and starts the backward pass at once;
- backward frames go upstream with the gradients of the stage's inputs and the leaf's loss;
- every node steps its optimizer after `updateFrequency x microbatches` backward passes;
- `sync`: the root waits for all microbatches of an update before it feeds the next (a flush per
  optimizer step), which equals single-process training with gradient accumulation;
- `async`: the root keeps up to `maxInFlight` microbatches in the pipeline across updates; each
  forward runs on a stash of the weights of its version, so its backward uses the same weights
  (weight stashing), and the gradients land on the live weights;
- at every `reduceFactor`-th update the root drains the pipeline, then each node averages its
  parameters and buffers with the nodes of the other clusters that own the same ones;
- validation, checkpoints and the end of training travel down the pipeline as control frames at
  drained points, so every node acts on the same weights.
"""

from __future__ import annotations

import logging
import math
import queue
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.func import functional_call

from ravnest.comm.dataplane import RingLink
from ravnest.comm.framing import Frame
from ravnest.comm.inboxes import Inbox
from ravnest.comm.transport import Peer
from ravnest.errors import PeerTimeout, RavnestError
from ravnest.plan.partitioning import OUTPUT, Stage
from ravnest.plan.plans import NodePlan, Plan
from ravnest.train import checkpointing
from ravnest.train.allreducing import FINAL_ROUND, RingReducer, reduce_all
from ravnest.train.heap import HeapTrimmer
from ravnest.train.metrics import WorkerMetrics
from ravnest.train.settings import Settings

log = logging.getLogger(__name__)

LABELS = "__labels__"


Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


@dataclass
class Batches:
    """The root's data: one cluster's shard of the training set, and the validation set."""

    train: Callable[[int], Iterator[Batch]]
    """epoch -> this cluster's (inputs, labels) batches of that epoch, in order."""
    per_epoch: int
    """Batches used per epoch (a multiple of updateFrequency; extra ones are not used)."""
    validation: Callable[[], Iterator[Batch]]


@dataclass
class Curve:
    """The learning curve and the best-model bookkeeping (as in the lamp training loop)."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    smoothed: float | None = None
    best_smoothed: float | None = None
    best_step: int | None = None
    last_val_loss: float | None = None
    last_val_metric: float | None = None


@dataclass
class _Pending:
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]
    stash: dict[str, torch.Tensor] | None
    labels: torch.Tensor | None
    control: dict[str, Any]


class NodeRuntime:
    """The training loop of one node."""

    def __init__(self, name: str, plan: Plan, stage: Stage, settings: Settings,
                 optimizer: torch.optim.Optimizer | None, scheduler: Any,
                 criterion: Callable[..., torch.Tensor] | None, inbox: Inbox,
                 peers: dict[str, Peer], metrics: WorkerMetrics, batches: Batches | None = None,
                 ring_peers: Mapping[str, RingLink] | None = None) -> None:
        """`ring_peers`: the ring successors' data-plane links (training.ringTransport: tcp);
        without them ring pieces go to `peers` over gRPC."""
        self.name = name
        self.plan = plan
        self.me: NodePlan = plan.node(name)
        self.stage = stage
        self.s = settings
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.criterion = criterion
        self.inbox = inbox
        self.peers = peers
        self.metrics = metrics
        self.batches = batches
        up, down = plan.neighbours(name)
        self.up = peers[up] if up else None
        self.down = peers[down] if down else None
        self.params = dict(stage.named_parameters())
        self.reducers = [
            (RingReducer(r, name, ring_peers or peers, inbox, settings.reduce_timeout,
                         compression=settings.compression),
             self._ring_tensors(r.state))
            for r in plan.rings_of(name)
        ]
        self.updates = 0
        self.backwards = 0
        self.version = 0
        self._stash: dict[str, torch.Tensor] | None = None
        self.pending: dict[int, _Pending] = {}
        self.in_flight = 0
        self.epoch = 0
        self.next_batch = 0
        self.samples = 0
        self.curve = Curve()
        self.best_state: dict[str, torch.Tensor] | None = None
        self._snapshot: dict[str, torch.Tensor] | None = None
        self._loss_sum = 0.0
        self._loss_n = 0
        self._eval: dict[str, float] = {}
        self._finished = False
        self._last_step_time = time.monotonic()
        self.rounds_skipped = 0
        self._trim_heap = HeapTrimmer()
        self.val_result: dict[str, Any] | None = None

    # ----------------------------------------------------------------------------- state

    def _ring_tensors(self, names: tuple[str, ...]
                      ) -> Callable[[], tuple[list[torch.Tensor], int]]:
        """A ring's tensors: the stage's own parameters and buffers (movable: the reducer keeps
        them as views of its buffer), then the optimizer's state if it is averaged too."""
        def tensors() -> tuple[list[torch.Tensor], int]:
            state = self.stage.stage_state_dict(keep_vars=True)
            out = [state[n] for n in names]
            movable = len(out)
            if self.s.average_optimizer:
                for n in names:
                    p = self.params.get(f"graph_module.{n}")
                    opt_state = (self.optimizer.state.get(p, {})
                                 if p is not None and self.optimizer is not None else {})
                    out += [v for k, v in sorted(opt_state.items())
                            if isinstance(v, torch.Tensor) and k != "step" and v.dim() > 0]
            return out, movable

        return tensors

    def state(self) -> dict[str, Any]:
        """Everything needed to resume this node."""
        return {
            "stage": self.stage.stage_state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "updates": self.updates, "epoch": self.epoch, "next_batch": self.next_batch,
            "samples": self.samples, "rng": torch.get_rng_state(),
            "curve": {"rows": self.curve.rows, "smoothed": self.curve.smoothed,
                      "best_smoothed": self.curve.best_smoothed,
                      "best_step": self.curve.best_step,
                      "last_val_loss": self.curve.last_val_loss,
                      "last_val_metric": self.curve.last_val_metric},
            "best": self.best_state,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.stage.graph_module.load_state_dict(state["stage"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.updates, self.epoch = state["updates"], state["epoch"]
        self.next_batch, self.samples = state["next_batch"], state["samples"]
        torch.set_rng_state(state["rng"])
        self.curve = Curve(**state["curve"])
        self.best_state = state["best"]
        self.metrics.step.set(self.updates)

    def resume(self) -> int | None:
        """Load the newest checkpoint complete for every node, if any; return its step."""
        if not self.s.checkpoint_dir:
            return None
        step = checkpointing.latest(self.s.checkpoint_dir, self.plan.names())
        if step is None:
            return None
        self.load_state(checkpointing.load(self.s.checkpoint_dir, step, self.name))
        self.metrics.checkpoint_step.set(step)
        log.info("%s resumed from checkpoint at step %d (epoch %d, batch %d)", self.name, step,
                 self.epoch, self.next_batch)
        return step

    # ----------------------------------------------------------------------------- frames

    def _send_down(self, frame: Frame) -> None:
        assert self.down is not None
        frame.sender = self.name
        with self.metrics.timed("communication"):
            self.down.post(frame, snapshot=False)  # pipeline tensors are never written again

    def _send_up(self, frame: Frame) -> None:
        assert self.up is not None
        frame.sender = self.name
        with self.metrics.timed("communication"):
            self.up.post(frame, snapshot=False)

    def _next_frame(self) -> Frame:
        try:
            with self.metrics.timed("waiting"):
                return self.inbox.pipeline.get(timeout=self.s.peer_timeout)
        except queue.Empty:
            raise PeerTimeout(f"{self.name}: no frame from the pipeline for "
                              f"{self.s.peer_timeout:.0f}s") from None

    def handle(self, frame: Frame) -> None:
        if frame.kind == "forward":
            self._forward(frame.microbatch, frame.tensors, frame.control)
        elif frame.kind == "backward":
            self._backward(frame.microbatch, frame.tensors, frame.control)
        elif frame.kind == "eval":
            self._eval_forward(frame.tensors)
        elif frame.kind == "control":
            self._control(frame.control)
        else:
            raise RavnestError(f"{self.name}: unexpected frame kind {frame.kind!r}")

    # ----------------------------------------------------------------------------- compute

    def _weights(self) -> dict[str, torch.Tensor] | None:
        """The stash forward uses in async mode (None: live weights)."""
        if self.s.schedule != "async":
            return None
        if self._stash is None:
            self._stash = {k: p.detach().clone().requires_grad_(p.requires_grad)
                           for k, p in self.params.items()}
        return self._stash

    def _run_stage(self, inputs: dict[str, torch.Tensor],
                   weights: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        if weights is None:
            return self.stage(**inputs)
        out: dict[str, torch.Tensor] = functional_call(self.stage, weights, args=(),
                                                       kwargs=inputs, strict=False)
        return out

    def _forward(self, mb: int, tensors: dict[str, torch.Tensor], control: dict[str, Any]) -> None:
        labels = tensors.pop(LABELS, None)
        inputs = {k: (v.requires_grad_() if v.dtype.is_floating_point and not self.me.is_root
                      else v) for k, v in tensors.items()}
        missing = set(self.stage.input_names) - set(inputs)
        if missing:
            raise RavnestError(f"{self.name}: forward frame lacks {sorted(missing)}")
        self.stage.train()
        with self.metrics.timed("compute"):
            weights = self._weights()
            t0 = time.perf_counter()
            outputs = self._run_stage({k: inputs[k] for k in self.stage.input_names}, weights)
            self.metrics.forward_seconds.observe(time.perf_counter() - t0)
        self.pending[mb] = _Pending(inputs, outputs, weights, labels, control)
        if self.me.is_leaf:
            self._leaf_backward(mb)
        else:
            send = {k: v.detach() for k, v in outputs.items()}
            if labels is not None:
                send[LABELS] = labels
            self._send_down(Frame("forward", send, microbatch=mb, control=control))

    def _leaf_backward(self, mb: int) -> None:
        p = self.pending[mb]
        if p.labels is None or self.criterion is None:
            raise RavnestError(f"{self.name}: leaf got microbatch {mb} without labels")
        with self.metrics.timed("compute"):
            loss = self.criterion(p.outputs[OUTPUT], p.labels)
        n = int(p.labels.shape[0])
        scale = n / (self.s.batch_size * self.s.update_frequency)
        info = {**p.control, "loss": float(loss.detach()), "n": n}
        self._run_backward(mb, [loss * scale], [None], info)

    def _backward(self, mb: int, grads: dict[str, torch.Tensor], control: dict[str, Any]) -> None:
        p = self.pending[mb]
        outs, gs = [], []
        for k, g in grads.items():
            t = p.outputs.get(k)
            if t is None:
                raise RavnestError(f"{self.name}: gradient for unknown output {k!r}")
            if t.requires_grad:
                outs.append(t)
                gs.append(g)
        self._run_backward(mb, outs, gs, control)

    def _run_backward(self, mb: int, outs: list[torch.Tensor], grads: list[Any],
                      control: dict[str, Any]) -> None:
        p = self.pending.pop(mb)
        with self.metrics.timed("compute"):
            t0 = time.perf_counter()
            if outs:
                torch.autograd.backward(outs, grads)
            self.metrics.backward_seconds.observe(time.perf_counter() - t0)
            if p.stash is not None:
                with torch.no_grad():
                    for k, live in self.params.items():
                        g = p.stash[k].grad
                        if g is not None:
                            # the stash's gradient is dropped just below: take it, no copy
                            live.grad = g if live.grad is None else live.grad.add_(g)
                            p.stash[k].grad = None
        if self.me.is_root:
            self.in_flight -= 1
            self.metrics.in_flight.set(self.in_flight)
            self._loss_sum += control.get("loss", 0.0) * control.get("n", 0)
            self._loss_n += control.get("n", 0)
        else:
            in_grads = {k: (v.grad if v.grad is not None else torch.zeros_like(v))
                        for k, v in p.inputs.items() if v.requires_grad}
            self._send_up(Frame("backward", in_grads, microbatch=mb, control=control))
        self.backwards += 1
        if self.backwards % (self.s.update_frequency * self.s.microbatches) == 0:
            self._optimizer_step()

    def _optimizer_step(self) -> None:
        if self.optimizer is not None:
            with self.metrics.timed("compute"):
                if self.s.clip_norm is not None:
                    torch.nn.utils.clip_grad_norm_(list(self.params.values()), self.s.clip_norm)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None and self.s.scheduler_step_on == "step":
            self.scheduler.step()
        self._stash = None
        self.version += 1
        self.updates += 1
        now = time.monotonic()
        self.metrics.step_seconds.observe(now - self._last_step_time)
        self._last_step_time = now
        self.metrics.steps.inc()
        self.metrics.step.set(self.updates)
        self._trim_heap()
        if self.updates % self.s.reduce_factor == 0:
            self.all_reduce(self.updates // self.s.reduce_factor)

    def all_reduce(self, round_: int) -> None:
        if not self.reducers:
            return
        t0 = time.perf_counter()
        with self.metrics.timed("communication"):
            done, skipped = reduce_all(self.reducers, round_)
        self._stash = None
        self.metrics.allreduce_seconds.observe(time.perf_counter() - t0)
        self.metrics.reduce_rounds.inc(done)
        self.metrics.reduce_skipped.inc(skipped)
        self.rounds_skipped += skipped

    @torch.no_grad()
    def _eval_forward(self, tensors: dict[str, torch.Tensor]) -> None:
        labels = tensors.pop(LABELS, None)
        self.stage.eval()
        with self.metrics.timed("compute"):
            out = self.stage(**{k: tensors[k] for k in self.stage.input_names})
        if not self.me.is_leaf:
            send = dict(out)
            if labels is not None:
                send[LABELS] = labels
            self._send_down(Frame("eval", send))
            return
        assert labels is not None and self.criterion is not None
        pred = out[OUTPUT]
        n = int(labels.shape[0])
        e = self._eval
        with self.metrics.timed("compute"):
            e["loss"] = e.get("loss", 0.0) + float(self.criterion(pred, labels)) * n
        e["n"] = e.get("n", 0) + n
        if self.s.metric == "accuracy":
            mask = labels != -100
            e["correct"] = e.get("correct", 0) + int((pred.argmax(1) == labels)[mask].sum())
            e["count"] = e.get("count", 0) + int(mask.sum())

    # ----------------------------------------------------------------------------- control

    def _control(self, c: dict[str, Any]) -> None:
        op = c.get("op")
        if op == "eval_end":
            self._snapshot = {k: v.clone() for k, v in self.stage.stage_state_dict().items()}
            if self.me.is_leaf:
                self._finish_validation(c)
            else:
                self._send_down(Frame("control", control=c))
        elif op == "val_result":
            if c.get("best"):
                self.best_state = self._snapshot
            if self.me.is_root:
                self.val_result = c
            else:
                self._send_up(Frame("control", control=c))
        elif op == "epoch_end":
            self._epoch_end(int(c["epoch"]))
            if not self.me.is_leaf:
                self._send_down(Frame("control", control=c))
        elif op == "checkpoint":
            if not self.me.is_leaf:
                self._send_down(Frame("control", control=c))
            self._checkpoint(c)
        elif op == "final_reduce":
            if not self.me.is_leaf:
                self._send_down(Frame("control", control=c))
            self.all_reduce(FINAL_ROUND)
        elif op == "finish":
            if not self.me.is_leaf:
                self._send_down(Frame("control", control=c))
            self._finished = True
        else:
            raise RavnestError(f"{self.name}: unknown control {op!r}")

    def _epoch_end(self, epoch: int) -> None:
        self.epoch = epoch + 1
        if self.scheduler is not None and self.s.scheduler_step_on == "epoch":
            self.scheduler.step()

    def _finish_validation(self, c: dict[str, Any]) -> None:
        e, self._eval = self._eval, {}
        n = max(e.get("n", 0), 1)
        val_loss = e.get("loss", math.nan) / n
        metric = e["correct"] / max(e["count"], 1) if "count" in e else None
        a = self.s.validation_smoothing
        cv = self.curve
        cv.smoothed = val_loss if cv.smoothed is None else a * val_loss + (1 - a) * cv.smoothed
        best = cv.best_smoothed is None or cv.smoothed < cv.best_smoothed
        result = {"op": "val_result", "epoch": c["epoch"], "step": c["step"],
                  "val_loss": val_loss, "val_metric": metric, "smoothed": cv.smoothed,
                  "best": best}
        self._control(result)

    def _checkpoint(self, c: dict[str, Any]) -> None:
        if not self.s.checkpoint_dir:
            return
        self.next_batch, self.epoch = int(c["next_batch"]), int(c["epoch"])
        step = int(c["step"])
        checkpointing.save(self.s.checkpoint_dir, step, self.name, self.state())
        checkpointing.prune(self.s.checkpoint_dir, self.plan.names(), self.s.checkpoint_keep)
        self.metrics.checkpoint_step.set(step)

    # ----------------------------------------------------------------------------- loops

    def serve(self) -> None:
        """Loop of a non-root node: handle frames until the root says training is over."""
        self.metrics.start_loop()
        while not self._finished:
            self.handle(self._next_frame())
        self._flush_peers()

    def _flush_peers(self) -> None:
        for peer in (self.up, self.down):
            if peer is not None:
                with self.metrics.timed("communication"):
                    peer.flush(self.s.peer_timeout)

    def _wait_until(self, done: Callable[[], bool]) -> None:
        while not done():
            self.handle(self._next_frame())

    def _feed(self, inputs: tuple[torch.Tensor, ...], labels: torch.Tensor, mb: int) -> None:
        self._wait_until(lambda: self.in_flight < self.s.max_in_flight)
        tensors = dict(zip(self.stage.input_names, inputs, strict=True))
        tensors[LABELS] = labels
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)
        self._forward(mb, tensors, {})

    def drive(self, on_update: Callable[[NodeRuntime], None] | None = None) -> None:
        """Loop of a cluster's root: feed every batch, validate, checkpoint, finish."""
        assert self.batches is not None
        self.metrics.start_loop()
        s, b = self.s, self.batches
        total_updates = s.epochs * (b.per_epoch // s.update_frequency)
        self.metrics.total_steps.set(total_updates)
        mb_id = (self.epoch * b.per_epoch + self.next_batch) * s.microbatches
        while self.epoch < s.epochs:
            epoch = self.epoch
            last = epoch + 1 == s.epochs
            self.metrics.epoch.set(epoch)
            for batch, (inputs, labels) in enumerate(b.train(epoch)):
                if batch >= b.per_epoch:
                    break
                if batch < self.next_batch:
                    continue
                self._feed_batch(inputs, labels, mb_id)
                mb_id += s.microbatches
                if (batch + 1) % s.update_frequency:
                    continue
                # the update this batch completes, counted from what was fed (in async mode the
                # optimizer steps of this node run behind the feeding); async drains only where
                # every node must act on the same weights: a ring round (none with one cluster),
                # a checkpoint, the end of the epoch
                update = (epoch * b.per_epoch + batch + 1) // s.update_frequency
                drain = (s.schedule == "sync"
                         or (self.plan.rings and update % s.reduce_factor == 0)
                         or (s.checkpoint_every and update % s.checkpoint_every == 0)
                         or batch + 1 == b.per_epoch)
                if not drain:
                    continue
                self._wait_until(lambda: self.in_flight == 0)
                self._record_loss()
                if s.checkpoint_every and self.updates % s.checkpoint_every == 0:
                    self._send_checkpoint(epoch, batch + 1)
                if on_update is not None:
                    on_update(self)
            self._wait_until(lambda: self.in_flight == 0)
            if last:
                self._control({"op": "final_reduce"})
            if (epoch + 1) % s.validation_frequency == 0 or last:
                self._validate(epoch)
            self._control({"op": "epoch_end", "epoch": epoch})
            self.next_batch = 0
            if not s.checkpoint_every or last:
                self._send_checkpoint(epoch + 1, 0)
        self._control({"op": "finish"})
        self._flush_peers()

    def _feed_batch(self, inputs: tuple[torch.Tensor, ...], labels: torch.Tensor,
                    first_mb: int) -> None:
        if labels.shape[0] != self.s.batch_size:
            raise RavnestError(f"{self.name}: a training batch has {labels.shape[0]} samples, "
                               f"expected batch size {self.s.batch_size} (drop the last batch)")
        pieces = [x.tensor_split(self.s.microbatches) for x in inputs]
        for m, y in enumerate(labels.tensor_split(self.s.microbatches)):
            self._feed(tuple(p[m] for p in pieces), y, first_mb + m)
        self.samples += int(labels.shape[0])
        self.metrics.samples.inc(int(labels.shape[0]))

    def _record_loss(self) -> None:
        if not self._loss_n:
            return
        loss = self._loss_sum / self._loss_n
        self._loss_sum, self._loss_n = 0.0, 0
        self.metrics.loss.set(loss)
        self.curve.rows.append({"epoch": self.epoch, "step": self.updates, "samples": self.samples,
                                "train_loss": loss, "time": time.time()})

    def _send_checkpoint(self, epoch: int, next_batch: int) -> None:
        if self.s.checkpoint_dir:
            self._control({"op": "checkpoint", "step": self.updates, "epoch": epoch,
                           "next_batch": next_batch})

    def _validate(self, epoch: int) -> None:
        assert self.batches is not None
        self.val_result = None
        for inputs, labels in self.batches.validation():
            tensors = dict(zip(self.stage.input_names, inputs, strict=True))
            tensors[LABELS] = labels
            self._eval_forward(tensors)
        self._control({"op": "eval_end", "epoch": epoch, "step": self.updates})
        self._wait_until(lambda: self.val_result is not None)
        r = self.val_result
        assert r is not None
        cv = self.curve
        cv.last_val_loss, cv.last_val_metric = r["val_loss"], r["val_metric"]
        if r["best"]:
            cv.best_smoothed, cv.best_step = r["smoothed"], r["step"]
        self.metrics.val_loss.set(r["val_loss"])
        if r["val_metric"] is not None:
            self.metrics.val_metric.set(r["val_metric"])
        cv.rows.append({"epoch": epoch, "step": self.updates, "samples": self.samples,
                        "val_loss": r["val_loss"], "val_metric": r["val_metric"],
                        "time": time.time()})
