"""A worker process: one provider, started from its node metadata (a file or a ConfigMap mount).

It rebuilds the model from the job spec (same seed everywhere), keeps only its stage, checks the
stage against the plan and the plan against its fingerprint, serves gRPC and /metrics, waits for
its neighbours, resumes from the newest complete checkpoint, trains, and writes its outputs.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

from ravnest.comm.dataplane import RingLink, RingServer
from ravnest.comm.inboxes import Inbox
from ravnest.comm.tls import TlsMaterial, identity
from ravnest.comm.transport import Credentials, Peer, Server
from ravnest.errors import PlanError, RavnestError, SpecError
from ravnest.plan import building
from ravnest.plan.partitioning import Stage, build_stage, profile
from ravnest.plan.plans import Plan, fingerprint
from ravnest.spec import Job, JobSpec, parse_job
from ravnest.train.metrics import Identity, WorkerMetrics
from ravnest.train.runtime import Batch, Batches, NodeRuntime
from ravnest.train.settings import Settings

FINAL_SCRAPE_ENV = "RAVNEST_FINAL_SCRAPE_SECONDS"

log = logging.getLogger(__name__)

METADATA_KIND = "RavnestNodeMetadata"


@dataclass(frozen=True)
class NodeMetadata:
    """Everything one worker needs, except the job's secret token."""

    job: Job
    plan: Plan
    node: str
    addresses: dict[str, str]
    """Node name -> host:port of its gRPC server."""
    output_dir: str
    listen: str = "0.0.0.0:50051"
    metrics_port: int = 9400
    namespace: str = "default"
    tls_dir: str | None = None
    """Folder with this node's `ca.crt`, `tls.crt` and `tls.key` when the job uses TLS."""
    ring_addresses: dict[str, str] | None = None
    """Node name -> host:port of its ring data server (training.ringTransport: tcp)."""
    ring_listen: str = "0.0.0.0:50052"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "apiVersion": "ravnest.io/v1alpha1", "kind": METADATA_KIND, "node": self.node,
            "job": self.job.to_dict(), "plan": self.plan.to_dict(),
            "addresses": self.addresses, "outputDir": self.output_dir,
            "listen": self.listen, "metricsPort": self.metrics_port,
            "namespace": self.namespace}
        if self.tls_dir is not None:
            d["tlsDir"] = self.tls_dir
        if self.ring_addresses is not None:
            d["ringAddresses"] = self.ring_addresses
            d["ringListen"] = self.ring_listen
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NodeMetadata:
        if d.get("kind") != METADATA_KIND:
            raise SpecError([f"kind: expected {METADATA_KIND!r}, got {d.get('kind')!r}"])
        return cls(job=parse_job(d["job"]), plan=Plan.from_dict(d["plan"]), node=d["node"],
                   addresses=dict(d["addresses"]), output_dir=d["outputDir"],
                   listen=d.get("listen", "0.0.0.0:50051"),
                   metrics_port=int(d.get("metricsPort", 9400)),
                   namespace=d.get("namespace", "default"), tls_dir=d.get("tlsDir"),
                   ring_addresses=(dict(d["ringAddresses"]) if d.get("ringAddresses") is not None
                                   else None),
                   ring_listen=d.get("ringListen", "0.0.0.0:50052"))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1, sort_keys=True))

    @classmethod
    def load(cls, path: str | Path) -> NodeMetadata:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, ValueError, KeyError) as e:
            raise SpecError([f"{path}: not valid node metadata ({e})"]) from e


def settings_from(spec: JobSpec, checkpoint_dir: str | None) -> Settings:
    t, c = spec.training, spec.checkpoint
    return Settings(
        epochs=t.epochs, batch_size=spec.data.batch_size, microbatches=spec.data.microbatches,
        update_frequency=t.update_frequency, reduce_factor=t.reduce_factor,
        average_optimizer=t.average_optimizer, schedule=t.schedule, max_in_flight=t.max_in_flight,
        validation_frequency=t.validation_frequency, validation_smoothing=t.validation_smoothing,
        clip_norm=t.gradient_clipping.max_norm if t.gradient_clipping else None,
        reduce_timeout=t.reduce_timeout_seconds, metric=t.metric, compression=t.compression,
        scheduler_step_on=t.lr_scheduler.step_on if t.lr_scheduler else "epoch",
        checkpoint_dir=checkpoint_dir, checkpoint_every=c.every_steps, checkpoint_keep=c.keep)


def _take(dataset: Dataset[Any], index: torch.Tensor) -> Batch:
    if isinstance(dataset, TensorDataset):
        *xs, y = (t[index] for t in dataset.tensors)
    else:
        *xs, y = default_collate([dataset[int(i)] for i in index])
    return tuple(xs), y


def cluster_batches(train: Dataset[Any], val: Dataset[Any], spec: JobSpec, cluster: int,
                    clusters: int) -> Batches:
    """The data of one cluster.

    Each epoch the training set is permuted with seed `data.seed + epoch` (or kept in order when
    `shuffle` is off); global batch b is the slice ``[b*K*B, (b+1)*K*B)`` of that order and cluster
    c trains on its c-th block of B samples. Batches per epoch are the same for every cluster and
    a multiple of `updateFrequency`, so every node sees the same number of updates.
    """
    bsz, k = spec.data.batch_size, clusters
    n = len(train)  # type: ignore[arg-type]
    uf = spec.training.update_frequency
    per_epoch = n // (k * bsz) // uf * uf
    if per_epoch == 0:
        raise SpecError([f"spec.data.batchSize: {n} training samples cannot fill one update of "
                         f"{k} cluster(s) x {bsz} samples x {uf} batches; lower batchSize"])

    def order(epoch: int) -> torch.Tensor:
        if not spec.data.shuffle:
            return torch.arange(n)
        return torch.randperm(n, generator=torch.Generator().manual_seed(spec.data.seed + epoch))

    def batches(epoch: int) -> Iterator[Batch]:
        perm = order(epoch)
        for b in range(per_epoch):
            start = (b * k + cluster) * bsz
            yield _take(train, perm[start:start + bsz])

    def validation() -> Iterator[Batch]:
        nv = len(val)  # type: ignore[arg-type]
        for start in range(0, nv, bsz):
            yield _take(val, torch.arange(start, min(start + bsz, nv)))

    return Batches(train=batches, per_epoch=per_epoch, validation=validation)


def build_node_stage(spec: JobSpec, plan: Plan, node: str) -> Stage:
    """Rebuild the model and cut out this node's stage, checking it matches the plan."""
    model = building.build_model(spec)
    gm, prof = profile(model, building.example_inputs(spec))
    me = plan.node(node)
    if me.end > len(prof.layers) or prof.layers[me.start].name != me.first_layer or \
            prof.layers[me.end - 1].name != me.last_layer:
        raise PlanError(f"{node}: the model built here does not match the plan (stage "
                        f"{me.first_layer}..{me.last_layer}); was the model code changed?")
    return build_stage(gm, me.start, me.end)


class Worker:
    """A running worker: server, peers, metrics and the training loop."""

    def __init__(self, meta: NodeMetadata, token: str) -> None:
        if not token:
            raise RavnestError("no job token: set RAVNEST_TOKEN (a Secret on Kubernetes)")
        self.meta = meta
        spec, plan = meta.job.spec, meta.plan
        me = plan.node(meta.node)
        self.me = me
        if fingerprint(plan, building.identity(spec)) != plan.fingerprint:
            raise PlanError(f"{meta.node}: the plan in the node metadata does not match its "
                            f"fingerprint {plan.fingerprint}; metadata altered or from another job")
        stage = build_node_stage(spec, plan, meta.node)
        self.metrics = WorkerMetrics(Identity(meta.job.name, meta.namespace, me.name, me.role,
                                              me.cluster, me.stage))
        creds = Credentials(token, plan.fingerprint)
        tls = None
        if spec.security.tls:
            if not meta.tls_dir:
                raise RavnestError(f"{meta.node}: spec.security.tls is on but the node metadata "
                                   f"names no tlsDir with the node's certificate")
            tls = TlsMaterial.load(meta.tls_dir)
        self.inbox = Inbox(capacity=4 * spec.training.max_in_flight + 64)
        self.server = Server(meta.listen, creds, self.inbox.deliver,
                             on_bytes=self.metrics.received, tls=tls)
        up, down = plan.neighbours(me.name)
        wanted = {n for n in (up, down) if n} | {m for r in plan.rings_of(me.name)
                                                 for m in r.members if m != me.name}
        self.peers = {n: Peer(meta.addresses[n], creds, spec.training.compression,
                              on_bytes=self.metrics.sent, tls=tls, server_name=identity(n))
                      for n in sorted(wanted)}
        self.ring_server: RingServer | None = None
        ring_links: dict[str, RingLink] = {}
        if spec.training.ring_transport == "tcp" and plan.rings_of(me.name):
            if meta.ring_addresses is None:
                raise RavnestError(f"{meta.node}: spec.training.ringTransport is tcp but the node "
                                   f"metadata names no ringAddresses")
            self.ring_server = RingServer(meta.ring_listen, token, plan.fingerprint,
                                          self.inbox.deliver, on_bytes=self.metrics.received,
                                          tls=tls, inbox=self.inbox)
            successors = {r.successor(me.name) for r in plan.rings_of(me.name)
                          if len(r.members) > 1}
            for n in sorted(successors):
                if n not in meta.ring_addresses:
                    raise RavnestError(f"{meta.node}: ringAddresses has no address for {n}")
                ring_links[n] = RingLink(meta.ring_addresses[n], token, plan.fingerprint, me.name,
                                         spec.training.compression,
                                         timeout=spec.training.reduce_timeout_seconds,
                                         on_bytes=self.metrics.sent, tls=tls,
                                         server_name=identity(n))
        self.ring_links = ring_links
        params = [p for p in stage.parameters() if p.requires_grad]
        optimizer = building.build_optimizer(spec, params) if params else None
        scheduler = building.build_scheduler(spec, optimizer) if optimizer else None
        criterion = building.build_criterion(spec) if me.is_leaf else None
        batches = None
        if me.is_root:
            train, val = building.build_datasets(spec)
            batches = cluster_batches(train, val, spec, me.cluster, len(plan.clusters))
        ckpt = str(Path(meta.output_dir) / spec.checkpoint.path) if not os.path.isabs(
            spec.checkpoint.path) else spec.checkpoint.path
        self.runtime = NodeRuntime(me.name, plan, stage, settings_from(spec, ckpt), optimizer,
                                   scheduler, criterion, self.inbox, self.peers, self.metrics,
                                   batches, ring_peers=ring_links or None)
        self.metrics_port = 0

    def run(self) -> None:
        host = self.meta.listen.rsplit(":", 1)[0]
        self.metrics_port = self.metrics.serve(self.meta.metrics_port, addr=host)
        self.server.start()
        if self.ring_server is not None:
            self.ring_server.start()
        try:
            for peer in self.peers.values():
                peer.wait_ready(self.runtime.s.peer_timeout)
            self.runtime.resume()
            if self.me.is_root:
                self.runtime.drive()
            else:
                self.runtime.serve()
            self._write_outputs()
            self.metrics.finished.set(1)
            self._await_final_scrape()
        finally:
            for peer in self.peers.values():
                peer.close()
            for link in self.ring_links.values():
                link.close()
            if self.ring_server is not None:
                self.ring_server.stop()
            self.server.stop()

    def _await_final_scrape(self) -> None:
        """Where Prometheus scrapes the workers (the chart's PodMonitor sets
        RAVNEST_FINAL_SCRAPE_SECONDS), stay until one scrape has read the final figures, or that
        many seconds: a pod gone between two scrapes would leave its last steps unrecorded."""
        raw = os.environ.get(FINAL_SCRAPE_ENV, "")
        try:
            seconds = float(raw) if raw else 0.0
        except ValueError:
            log.warning("%s=%r is not a number of seconds: not waiting", FINAL_SCRAPE_ENV, raw)
            return
        if seconds > 0 and not self.metrics.wait_for_scrape(seconds):
            log.info("no scrape of the final metrics within %.0f s", seconds)

    def _write_outputs(self) -> None:
        out = Path(self.meta.output_dir)
        (out / "stages").mkdir(parents=True, exist_ok=True)
        rt = self.runtime
        torch.save({"cluster": self.me.cluster, "stage": self.me.stage,
                    "state": rt.stage.stage_state_dict(), "best": rt.best_state},
                   out / "stages" / f"{self.me.name}.pt")
        result: dict[str, Any] = {"node": self.me.name, "updates": rt.updates,
                                  "rounds_skipped": rt.rounds_skipped}
        if self.me.is_root:
            (out / "clusters").mkdir(parents=True, exist_ok=True)
            train_losses = [r["train_loss"] for r in rt.curve.rows if "train_loss" in r]
            result.update({"cluster": self.me.cluster, "samples": rt.samples,
                           "train_loss": train_losses[-1] if train_losses else None,
                           "best_step": rt.curve.best_step,
                           "best_smoothed": rt.curve.best_smoothed,
                           "val_loss": rt.curve.last_val_loss,
                           "val_metric": rt.curve.last_val_metric})
            (out / "clusters" / f"cluster_{self.me.cluster}.json").write_text(
                json.dumps({**result, "curve": rt.curve.rows}, indent=1))
        _termination_message(result)


def _termination_message(result: dict[str, Any]) -> None:
    """Leave the final figures where Kubernetes reads a container's termination message."""
    path = Path(os.environ.get("RAVNEST_TERMINATION_LOG", "/dev/termination-log"))
    try:
        path.write_text(json.dumps(result, separators=(",", ":"))[:4000])
    except OSError:
        log.debug("no termination log at %s", path)
