"""A worker process: one provider, started from its node metadata (a file or a ConfigMap mount).

It rebuilds the model from the job spec (same seed everywhere), keeps only its stage, checks the
stage against the plan and the plan against its fingerprint, serves gRPC and /metrics, waits for
its neighbours, resumes from the newest complete checkpoint (or, in a cluster its supervisor
restarted alone, `REJOIN_ENV`, takes its state from the other clusters: train/rejoining.py),
trains, and writes its outputs.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

from ravnest import termination
from ravnest.comm.dataplane import RingLink, RingServer
from ravnest.comm.transport import Peer, Server
from ravnest.errors import PlanError, RavnestError, SpecError
from ravnest.plan import building
from ravnest.plan.partitioning import Stage, profile
from ravnest.plan.plans import NodePlan, Plan, fingerprint
from ravnest.run import draining, finishing, growing, owning
from ravnest.run.assembling import assemble, connect, cut_stage, save_stage
from ravnest.run.metadata import (
    DEVICE_ENV,
    DRAIN_DIR_ENV,
    FINAL_SCRAPE_ENV,
    GONE_ENV,
    REJOIN_ENV,
    RUNNER_PID_ENV,
    TOKEN_ENV,
    NodeMetadata,
    host_of,
)
from ravnest.spec import Job, JobSpec
from ravnest.storing import PVC_ROOT, open_location
from ravnest.train import devices
from ravnest.train.metrics import Identity, WorkerMetrics
from ravnest.train.runtime import Batch, Batches
from ravnest.train.settings import Settings

log = logging.getLogger(__name__)


PR_SET_PDEATHSIG = 1
"""prctl(2) option: the signal this process gets when the thread that started it ends."""


def exit_with_runner(environ: Mapping[str, str]) -> None:
    """A worker started by the local runner (`RUNNER_PID_ENV` names it) dies with it: killed by
    the kernel the moment the runner ends, even by SIGKILL, so no worker trains on unsupervised
    (Linux's parent-death signal). Raises if the runner is already gone."""
    raw = environ.get(RUNNER_PID_ENV)
    if not raw:
        return
    prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)
    if prctl is None or prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        log.warning("cannot ask to be stopped with the runner (pid %s) here: stop this worker "
                    "yourself if the runner dies", raw)
        return
    if os.getppid() != int(raw):
        raise RavnestError(f"the runner (pid {raw}) that started this worker has ended: exiting")


def _take(dataset: Dataset[Any], index: torch.Tensor) -> Batch:
    if isinstance(dataset, TensorDataset):
        *xs, y = (t[index] for t in dataset.tensors)
    else:
        *xs, y = default_collate([dataset[int(i)] for i in index])
    return tuple(xs), y


GROWN_SEED_STRIDE = 1_000_003
"""How far apart the data seeds of clusters added to a running job are (`cluster_batches`)."""


def cluster_batches(train: Dataset[Any], val: Dataset[Any], spec: JobSpec, cluster: int,
                    clusters: int) -> Batches:
    """The data of one cluster of a job planned with `clusters` clusters.

    Each epoch the training set is permuted with seed `data.seed + epoch` (or kept in order when
    `shuffle` is off); global batch b is the slice ``[b*K*B, (b+1)*K*B)`` of that order and cluster
    c trains on its c-th block of B samples. Batches per epoch are the same for every cluster and
    a multiple of `updateFrequency`, so every node sees the same number of updates.

    A cluster added to the running job (c >= K, issue 20 grow) changes none of that: it trains on
    block ``c mod K`` of its own permutation, seeded ``data.seed + epoch + GROWN_SEED_STRIDE *
    (c div K)`` (shuffled even with `shuffle` off, so that it does not repeat a planned cluster's
    batches), with as many batches per epoch as the others.
    """
    bsz, k = spec.data.batch_size, clusters
    n = len(train)  # type: ignore[arg-type]
    uf = spec.training.update_frequency
    per_epoch = n // (k * bsz) // uf * uf
    if per_epoch == 0:
        raise SpecError([f"spec.data.batchSize: {n} training samples cannot fill one update of "
                         f"{k} cluster(s) x {bsz} samples x {uf} batches; lower batchSize"])
    block, salt = cluster % k, cluster // k

    def order(epoch: int) -> torch.Tensor:
        if not spec.data.shuffle and not salt:
            return torch.arange(n)
        seed = spec.data.seed + epoch + GROWN_SEED_STRIDE * salt
        return torch.randperm(n, generator=torch.Generator().manual_seed(seed))

    def batches(epoch: int) -> Iterator[Batch]:
        perm = order(epoch)
        for b in range(per_epoch):
            start = (b * k + block) * bsz
            yield _take(train, perm[start:start + bsz])

    def validation() -> Iterator[Batch]:
        nv = len(val)  # type: ignore[arg-type]
        for start in range(0, nv, bsz):
            yield _take(val, torch.arange(start, min(start + bsz, nv)))

    return Batches(train=batches, per_epoch=per_epoch, validation=validation)


def build_node_stage(spec: JobSpec, plan: Plan, node: str) -> Stage:
    """Rebuild the model and cut out this node's stage, checking it matches the plan."""
    gm, prof = profile(building.build_model(spec), building.example_inputs(spec))
    return cut_stage(gm, prof, plan, node, "was the model code changed?")


def hold_as_spare(meta: NodeMetadata, orders: IO[str] | None) -> NodeMetadata | None:
    """A hot spare's wait (`ravnest worker --spare`; `meta` names the spare): build the job's model
    once, so that its imports are done and its code is known to run here, then wait for one order
    on `orders`, a JSON line ``{"metadata": <node metadata file>, "rejoin": true, "gone": [...]}``:
    the metadata of the node whose stage this process now runs (as a worker whose cluster
    rejoins, when told; without the nodes `gone`, whose clusters drained since it was started).
    None: `orders` closed without one (the supervisor let the spare go). Without `orders` (a spare
    pod: the operator places the lost node's new pod where the spare was) it waits until it is
    stopped."""
    if meta.job is None:
        raise SpecError([f"{meta.node}: the node metadata names no job"])
    started = time.monotonic()
    building.build_model(meta.job.spec)
    log.info("%s: hot spare ready in %.1f s; waiting to take over a stage", meta.node,
             time.monotonic() - started)
    if orders is None:
        threading.Event().wait()
    assert orders is not None
    line = orders.readline()
    if not line.strip():
        log.info("%s: let go without taking over a stage", meta.node)
        return None
    try:
        order = json.loads(line)
        taken = NodeMetadata.load(str(order["metadata"]))
    except (ValueError, KeyError, TypeError) as e:
        raise SpecError([f"{meta.node}: not an order to take over a stage: {line[:200]!r} "
                         f"({e})"]) from e
    if taken.plan.fingerprint != meta.plan.fingerprint:
        raise PlanError(f"{meta.node}: told to take over {taken.node} of plan "
                        f"{taken.plan.fingerprint}, not this spare's plan {meta.plan.fingerprint}")
    if order.get("rejoin"):
        os.environ[REJOIN_ENV] = "1"
    gone = order.get("gone") or []
    if isinstance(gone, list) and all(isinstance(n, str) for n in gone) and gone:
        os.environ[GONE_ENV] = ",".join(gone)
    log.warning("%s takes over the stage of %s (%.1f s after it was started)", meta.node,
                taken.node, time.monotonic() - started)
    return taken


def _device(spec: JobSpec, me: NodePlan) -> torch.device:
    """Where this worker trains: its provider's device (`DEVICE_ENV`, set by whoever started
    it; else the planned provider's), checked against what torch sees here."""
    device = devices.resolve(
        os.environ.get(DEVICE_ENV) or spec.expanded_providers()[me.provider].device,
        f"{me.name} (provider {me.provider})")
    if device.type != "cpu":
        log.info("%s trains its stage on %s (%s)", me.name, device,
                 torch.cuda.get_device_name(device))
    return device


def _lease(job: Job, me: NodePlan, pvc_root: str) -> owning.Lease | None:
    """On Kubernetes, a root's hold on the job's checkpoint folder, which the planner pod took:
    renewed while it trains, and no checkpoint is written once another job took it."""
    where = owning.in_pods(job, pvc_root) if me.is_root else None
    return owning.Lease(where, job) if where is not None else None


class Worker:
    """A running worker: server, peers, metrics and the training loop."""

    def __init__(self, meta: NodeMetadata, token: str, pvc_root: str = PVC_ROOT) -> None:
        """`pvc_root`: where the pod mounts the claims of the job's ``pvc://`` locations."""
        if not token:
            raise RavnestError(f"no job token: set {TOKEN_ENV} (a Secret on Kubernetes)")
        if meta.job is None:
            raise SpecError([f"{meta.node}: the node metadata names no job (clusterize() writes "
                             f"such metadata for the seed API's Node)"])
        self.meta = meta
        job, plan = meta.job, meta.plan
        spec, t = job.spec, job.spec.training
        self.spec = spec
        me = self.me = plan.node(meta.node)
        if fingerprint(plan, building.identity(spec)) != plan.fingerprint:
            raise PlanError(f"{meta.node}: the plan in the node metadata does not match its "
                            f"fingerprint {plan.fingerprint}; metadata altered or from another job")
        self.device = _device(spec, me)
        stage = build_node_stage(spec, plan, meta.node).to(self.device)
        self.metrics = WorkerMetrics(Identity(job.name, meta.namespace, me.name, me.role,
                                              me.cluster, me.stage))
        self.wiring = connect(meta, token, self.metrics, tls=spec.security.tls,
                              tcp_ring=t.ring_transport == "tcp", compression=t.compression,
                              reduce_timeout=t.reduce_timeout_seconds,
                              inbox_capacity=4 * t.max_in_flight + 64,
                              pinned=self.device.type == "cuda")
        params = [p for p in stage.parameters() if p.requires_grad]
        optimizer = building.build_optimizer(spec, params) if params else None
        scheduler = building.build_scheduler(spec, optimizer) if optimizer else None
        criterion = building.build_criterion(spec) if me.is_leaf else None
        batches = None
        if me.is_root:
            train, val = building.build_datasets(spec)
            batches = cluster_batches(train, val, spec, me.cluster, plan.planned)
        ckpt = open_location(spec.checkpoint.path, spec.storage.options(pvc_root),
                             base=meta.output_dir)
        self.drain_dir = os.environ.get(DRAIN_DIR_ENV, "")
        drain_asked = (functools.partial(draining.ordered, Path(self.drain_dir), me.cluster)
                       if me.is_root and self.drain_dir else None)
        self.runtime = assemble(self.wiring, meta, stage,
                                Settings.from_spec(spec, ckpt, device=str(self.device)),
                                self.metrics, optimizer, scheduler, criterion, batches,
                                drain_asked=drain_asked)
        self.metrics_port = 0
        self.pvc_root = pvc_root
        self.started = time.monotonic()
        self.resumed_from = 0
        """The checkpoint step training resumed from (0: the start)."""
        self.rejoin = (os.environ.get(REJOIN_ENV) == "1" or plan.grown(me.cluster)) and len(
            plan.clusters) > 1
        """Whether this worker's cluster was restarted alone, or added to the running job, and
        joins the others (it never resumes from a checkpoint)."""
        gone = set(filter(None, os.environ.get(GONE_ENV, "").split(",")))
        for name in gone:
            self.wiring.membership.leave(name, 0)
        if not self.rejoin:  # (a whole restart: the clusters added to the job join again)
            for c in plan.clusters[plan.planned:]:
                for name in c.nodes:
                    self.wiring.membership.lost(name)
        self.runtime.checkpoints.without(gone)
        self.lease = _lease(job, me, pvc_root)

    @property
    def server(self) -> Server:
        return self.wiring.server

    @property
    def peers(self) -> dict[str, Peer]:
        return self.wiring.peers

    @property
    def ring_server(self) -> RingServer | None:
        return self.wiring.ring_server

    @property
    def ring_links(self) -> dict[str, RingLink]:
        return self.wiring.ring_links

    def run(self) -> None:
        host = host_of(self.meta.listen)
        self.metrics_port = self.metrics.serve(self.meta.metrics_port, addr=host)
        if self.rejoin:
            self.wiring.rejoining(True)
        if self.lease is not None:
            self.lease.renew()  # (SpecError: another job writes the folder now)
            self.runtime.checkpoints.guard = self.lease.keep().check
        self.wiring.start()
        failed = True
        try:
            self.wiring.wait_ready(self.runtime.s.peer_timeout,
                                   *((self.meta.plan, self.meta.node) if self.rejoin else ()))
            # a pipeline neighbour that dies or falls silent stops this node in seconds (and it
            # tells its other neighbours why), instead of a frame's wait running out; a ring
            # member that does is left out of the rounds that follow
            self.wiring.watch_peers(self.meta.plan, self.meta.node)
            self.started = time.monotonic()
            try:
                if self.rejoin:
                    self.runtime.rejoin()
                    self.wiring.rejoining(False)
                    self._acknowledge_join()
                else:
                    self.resumed_from = self.runtime.resume() or 0
                if self.me.is_root:
                    self.runtime.drive()
                else:
                    self.runtime.serve()
            except torch.OutOfMemoryError as e:
                error = self._out_of_memory(e)
                self.wiring.abort(self.meta.plan, self.meta.node, error)
                raise error from e
            except BaseException as e:
                self.wiring.abort(self.meta.plan, self.meta.node, e)
                raise
            self.wiring.stop_watching()
            if self.runtime.leave_after is not None:
                self._acknowledge_drain()
            else:
                self._write_outputs()
            self.metrics.finished.set(1)
            failed = False
            self._await_final_scrape()
        finally:
            if self.lease is not None:
                self.lease.stop()  # (not given back: the other roots still hold it)
            self.wiring.close(failed=failed, neighbours=[
                n for n in self.meta.plan.neighbours(self.meta.node) if n is not None])

    def _out_of_memory(self, e: torch.OutOfMemoryError) -> RavnestError:
        """A device out of memory, said with the node, its stage, and the memory planned
        against the memory used."""
        me, used = self.me, ""
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            used = (f"; torch held at most {peak / 2**30:.2f} GiB, and the device has "
                    f"{total / 2**30:.2f} GiB ({free / 2**30:.2f} free now)")
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return RavnestError(
            f"{me.name} (cluster {me.cluster}, stage {me.stage}: layers {me.first_layer} to "
            f"{me.last_layer}) ran out of memory on {self.device}: the plan gave its stage "
            f"{me.memory_bytes / 2**30:.2f} GiB to train of the provider's {me.ram_gb:g} GB"
            f"{used}. Give the provider more memory in the job (spec.providers[].ram is the GPU's "
            f"memory for a cuda provider), or use smaller batches ({first})")

    def _await_final_scrape(self) -> None:
        """Where Prometheus scrapes the workers (the chart's PodMonitor sets
        FINAL_SCRAPE_ENV), stay until one scrape has read the final figures, or that
        many seconds: a pod gone between two scrapes would leave its last steps unrecorded."""
        raw = os.environ.get(FINAL_SCRAPE_ENV, "")
        try:
            seconds = float(raw) if raw else 0.0
        except ValueError:
            log.warning("%s=%r is not a number of seconds: not waiting", FINAL_SCRAPE_ENV, raw)
            return
        if seconds > 0 and not self.metrics.wait_for_scrape(seconds):
            log.info("no scrape of the final metrics within %.0f s", seconds)

    def _acknowledge_join(self) -> None:
        """The root of a cluster added to the running job joined it: it says so, for the local
        runner (`cluster_<c>.joined` in the drain folder; `growing`)."""
        rt = self.runtime
        if not (self.me.is_root and self.meta.plan.grown(self.me.cluster) and rt.rejoined
                and self.drain_dir and os.access(self.drain_dir, os.W_OK)):
            return
        try:
            growing.joined_file(Path(self.drain_dir), self.me.cluster).write_text(
                json.dumps(rt.rejoined))
        except OSError as e:
            log.warning("could not acknowledge the join in %s: %s", self.drain_dir, e)

    def _acknowledge_drain(self) -> None:
        """This node's cluster drained: its stage and figures are not the job's (the others'
        final round is); the root acknowledges the order (`cluster_<c>.done`)."""
        rt = self.runtime
        result = {"node": self.me.name, "updates": rt.updates,
                  "drained": {"round": rt.leave_after, "updates": rt.updates}}
        log.warning("%s drained after round %s at update %d: it leaves the job", self.me.name,
                    rt.leave_after, rt.updates)
        if self.me.is_root and self.drain_dir and os.access(self.drain_dir, os.W_OK):
            # (a pod's drain folder is a read-only downward-API volume: the operator reads the
            # termination message instead)
            try:
                draining.acknowledge(Path(self.drain_dir), self.me.cluster, {
                    "round": rt.leave_after, "updates": rt.updates, "samples": rt.samples})
            except OSError as e:  # (the termination message says it too)
                log.warning("could not acknowledge the drain in %s: %s", self.drain_dir, e)
        termination.write_figures(result)

    def _write_outputs(self) -> None:
        """This node's stage, and a root's figures, in the job's output location; the figures
        also in the termination message, where Kubernetes keeps them."""
        rt = self.runtime
        where = finishing.output_location(self.spec, self.meta.output_dir, self.pvc_root)
        save_stage(rt, where.child(finishing.STAGES))
        result: dict[str, Any] = {"node": self.me.name, "updates": rt.updates,
                                  "rounds_skipped": rt.rounds_skipped,
                                  "rounds_partial": rt.rounds_partial}
        if rt.rejoined is not None:
            result["rejoined"] = rt.rejoined
        if rt.final_clusters is not None:
            result["final_clusters"] = sorted(rt.final_clusters)
        if self.me.is_root:
            train_losses = [r["train_loss"] for r in rt.curve.rows if "train_loss" in r]
            result.update({"cluster": self.me.cluster, "samples": rt.samples,
                           "train_loss": train_losses[-1] if train_losses else None,
                           "epoch": rt.curve.rows[-1]["epoch"] + 1 if rt.curve.rows else None,
                           "best_step": rt.curve.best_step,
                           "best_smoothed": rt.curve.best_smoothed,
                           "val_loss": rt.curve.last_val_loss,
                           "val_metric": rt.curve.last_val_metric})
            finishing.write_cluster(where, self.me.cluster, {
                **result, "resumed_from": self.resumed_from,
                "seconds": round(time.monotonic() - self.started, 3), "curve": rt.curve.rows})
        termination.write_figures(result)

