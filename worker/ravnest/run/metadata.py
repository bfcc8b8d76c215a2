"""Node metadata: the one description of a worker that everything which starts one shares.

The operator writes it into a node's ConfigMap, the local runner into `nodes/<node>.json`, the
seed API's `clusterize` into `node_data/nodes/<node>.json`; `ravnest worker` and the seed API's
`Node` read it back. Its JSON form, the workers' default ports, the environment variables a
worker reads and the address helpers live here so that writers and readers cannot drift apart.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ravnest.errors import RavnestError, SpecError
from ravnest.plan.plans import Plan
from ravnest.spec import Job, parse_job

API_VERSION = "ravnest.io/v1alpha1"
KIND = "RavnestNodeMetadata"

GRPC_PORT = 50051
"""A worker's gRPC port in a pod: pipeline frames, health, ring pieces over gRPC."""
RING_PORT = GRPC_PORT + 1
"""The ring data plane's port (training.ringTransport: tcp): one above the gRPC port."""
METRICS_PORT = 9400
"""A worker's Prometheus /metrics port in a pod."""

TOKEN_ENV = "RAVNEST_TOKEN"
"""The job's shared token (a Secret on Kubernetes); every peer presents it."""
TORCH_THREADS_ENV = "RAVNEST_TORCH_THREADS"
"""torch's intra-op threads for a worker (the provider's compute, rounded, on Kubernetes)."""
FINAL_SCRAPE_ENV = "RAVNEST_FINAL_SCRAPE_SECONDS"
"""Seconds a finished worker waits for one Prometheus scrape of its final metrics (0: none)."""
RUNNER_PID_ENV = "RAVNEST_RUNNER_PID"
"""The pid of the local runner that started this worker, which dies with it (unset: no runner)."""
REJOIN_ENV = "RAVNEST_REJOIN"
"""Set to 1 by the supervisor (the local runner, the operator) in the workers of a cluster it
restarted alone: they take their state from the other clusters and rejoin at a round boundary
(train/rejoining.py) instead of resuming from a checkpoint."""
DRAIN_DIR_ENV = "RAVNEST_DRAIN_DIR"
"""The folder where a worker's root finds `cluster_<c>`, a drain order for its cluster (non-empty:
drain), and leaves `cluster_<c>.done` once it drained."""
DEVICE_ENV = "RAVNEST_DEVICE"
"""The device of the provider a worker runs on (spec.providers[].device), set by whoever starts
it (the local runner per provider, the operator in the pod): a hot spare that takes a stage over
trains it on its own device. Unset: the planned provider's."""
GONE_ENV = "RAVNEST_GONE"
"""Comma-separated nodes of clusters that drained before this worker started (a whole restart
after a drain): its rounds go without them from the first on, and it does not wait for them."""

def endpoint(host: str, port: int) -> str:
    """`host:port`, as node metadata writes every address."""
    return f"{host}:{port}"


def listen_all(port: int) -> str:
    """The address that listens on every interface at `port`."""
    return endpoint("0.0.0.0", port)


def host_of(address: str) -> str:
    """The host of a `host:port` address."""
    return address.rsplit(":", 1)[0]


def port_of(address: str) -> int:
    """The port of a `host:port` address."""
    return int(address.rsplit(":", 1)[1])


def with_host(address: str, host: str) -> str:
    """The same port on another host: `with_host('node-3.svc:50051', '127.1.1.13')`."""
    return endpoint(host, port_of(address))


def ring_address(address: str) -> str:
    """Where a node's ring data plane listens, given its gRPC address: one port above it, as in
    pods (50051 / 50052)."""
    return endpoint(host_of(address), port_of(address) + 1)


@dataclass(frozen=True)
class NodeMetadata:
    """Everything one worker needs, except the job's secret token and its own identity."""

    plan: Plan
    node: str
    addresses: dict[str, str]
    """Node name -> host:port of its gRPC server."""
    job: Job | None = None
    """The job; None for the seed API's nodes, whose provider scripts bring model and data."""
    output_dir: str = "."
    """Folder of the node's outputs (stages/, clusters/, relative checkpoint paths)."""
    listen: str = listen_all(GRPC_PORT)
    metrics_port: int = METRICS_PORT
    namespace: str = "default"
    tls_dir: str | None = None
    """Folder with this node's `ca.crt`, `tls.crt` and `tls.key` when the job uses TLS."""
    ring_addresses: dict[str, str] | None = None
    """Node name -> host:port of its ring data server (training.ringTransport: tcp)."""
    ring_listen: str = listen_all(RING_PORT)
    microbatches: int | None = None
    """The seed API's microbatches per batch (a job's are its spec.data.microbatches)."""
    identity_file: str | None = None
    """This node's identity (`ravnest.comm.identity`), which only it may read: the key and
    certificate it proves itself to its peers with. Every worker needs one."""

    def to_dict(self, plan_file: str | None = None, job_file: str | None = None
                ) -> dict[str, Any]:
        """The JSON form. `plan_file`, `job_file`: where the reader finds the plan and the job
        (JSON files that every node of the job shares: on Kubernetes the plan ConfigMap's, so a
        job of a hundred nodes stores its plan once, not a hundred times), instead of them
        written in; a relative path is relative to the metadata file."""
        d: dict[str, Any] = {
            "apiVersion": API_VERSION, "kind": KIND, "node": self.node,
            "addresses": self.addresses,
            "outputDir": self.output_dir, "listen": self.listen,
            "metricsPort": self.metrics_port, "namespace": self.namespace}
        if plan_file is None:
            d["plan"] = self.plan.to_dict()
        else:
            d["planFile"] = plan_file
        if self.job is not None:
            if job_file is None:
                d["job"] = self.job.to_dict()
            else:
                d["jobFile"] = job_file
        if self.tls_dir is not None:
            d["tlsDir"] = self.tls_dir
        if self.ring_addresses is not None:
            d["ringAddresses"] = self.ring_addresses
            d["ringListen"] = self.ring_listen
        if self.microbatches is not None:
            d["microbatches"] = self.microbatches
        if self.identity_file is not None:
            d["identityFile"] = self.identity_file
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any],
                  read: Callable[[str], str] = lambda path: Path(path).read_text()
                  ) -> NodeMetadata:
        """The metadata of a JSON form; `read(path)`: the text of a `planFile` or `jobFile`."""
        if d.get("kind") != KIND:
            raise SpecError([f"kind: expected {KIND!r}, got {d.get('kind')!r}"])
        plan = d["plan"] if "plan" in d else json.loads(read(str(d["planFile"])))
        job = d["job"] if "job" in d else (
            json.loads(read(str(d["jobFile"]))) if "jobFile" in d else None)
        return cls(job=parse_job(job, template_allow=None) if job is not None else None,
                   plan=Plan.from_dict(plan), node=d["node"],
                   addresses=dict(d["addresses"]), output_dir=d["outputDir"],
                   listen=d.get("listen", cls.listen),
                   metrics_port=int(d.get("metricsPort", cls.metrics_port)),
                   namespace=d.get("namespace", cls.namespace), tls_dir=d.get("tlsDir"),
                   ring_addresses=(dict(d["ringAddresses"]) if d.get("ringAddresses") is not None
                                   else None),
                   ring_listen=d.get("ringListen", cls.ring_listen),
                   microbatches=int(d["microbatches"]) if "microbatches" in d else None,
                   identity_file=d.get("identityFile"))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1, sort_keys=True))

    @classmethod
    def load(cls, path: str | Path) -> NodeMetadata:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()),
                                 read=lambda file: (Path(path).parent / file).read_text())
        except SpecError as e:
            raise SpecError([f"{path}: {p}" for p in e.problems]) from e
        except (OSError, ValueError, KeyError) as e:
            raise SpecError([f"{path}: not valid node metadata ({e})"]) from e

    def rehosted(self, hosts: Mapping[str, str], listen_host: str) -> NodeMetadata:
        """The same ports on other hosts: each peer's addresses on `hosts[node]`, this node's
        listen addresses on `listen_host` (a test kubelet's pod IPs in place of DNS names)."""
        moved = replace(self, listen=with_host(self.listen, listen_host), addresses={
            n: with_host(a, hosts[n]) for n, a in self.addresses.items()})
        if self.ring_addresses is None:
            return moved
        return replace(moved, ring_listen=with_host(self.ring_listen, listen_host), ring_addresses={
            n: with_host(a, hosts[n]) for n, a in self.ring_addresses.items()})


def of_run(out: Path, running: bool, doing: str) -> NodeMetadata:
    """A node's metadata in the run folder `out`, for a command that acts on the running job
    (`doing`: what it does, for the error). Raises RavnestError with no run going on
    (`running`: whether a runner holds the folder) or no node metadata there."""
    if not running:
        raise RavnestError(f"no run is going on in {out}: start one with `ravnest run` (a "
                           f"{doing} a running job)")
    metas = sorted((out / "nodes").glob("node_*.json"))
    if not metas:
        raise RavnestError(f"{out}/nodes/ holds no node metadata: is {out} a run folder?")
    return NodeMetadata.load(metas[0])
