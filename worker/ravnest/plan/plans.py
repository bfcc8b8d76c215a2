"""The plan as data: providers, nodes, clusters, rings, and the `Plan` that holds them.

A plan is what the planner decides and every other part reads: workers and the operator load it
from JSON (`Plan.from_dict`), `ravnest plan` prints it (`Plan.table`), and its fingerprint ties
checkpoints and node metadata to one plan of one model. Nothing here decides anything; the
decisions are in `planning` and the arithmetic behind them in `costs`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

GB = 2**30
"""Bytes in one GB of provider RAM (GiB, as the seeds' node_configs.json counts it)."""
DEFAULT_BANDWIDTH_MBPS = 1000.0
"""Bandwidth assumed for a provider that states none."""


@dataclass(frozen=True)
class ProviderInfo:
    """One provider as the planner sees it: RAM in GB, bandwidth in Mbps, relative compute."""

    ram_gb: float
    bandwidth_mbps: float | None = None
    compute: float = 1.0

    @property
    def bytes_per_second(self) -> float:
        return (self.bandwidth_mbps or DEFAULT_BANDWIDTH_MBPS) * 1e6 / 8


@dataclass(frozen=True)
class NodePlan:
    name: str
    provider: int
    cluster: int
    stage: int
    role: str
    start: int
    end: int
    first_layer: str
    last_layer: str
    state: tuple[str, ...]
    params: int
    memory_bytes: int
    ram_gb: float
    seconds_per_microbatch: float

    @property
    def is_root(self) -> bool:
        return self.stage == 0

    @property
    def is_leaf(self) -> bool:
        return self.role in ("leaf", "root-leaf")


@dataclass(frozen=True)
class ClusterPlan:
    id: int
    nodes: tuple[str, ...]
    seconds_per_batch: float


@dataclass(frozen=True)
class RingPlan:
    id: str
    members: tuple[str, ...]
    """One node per cluster, in cluster order; a node's rank is its index here."""
    state: tuple[str, ...]
    """Parameter and buffer names the ring averages, in state_dict order."""

    def successor(self, name: str) -> str:
        """The member `name` sends its pieces to (itself in a ring of one)."""
        return self.members[(self.members.index(name) + 1) % len(self.members)]


def spare_name(provider: int) -> str:
    """A spare's name, `spare_<provider>` (on Kubernetes its pod is `<job>-spare-<provider>`)."""
    return f"spare_{provider}"


@dataclass(frozen=True)
class SparePlan:
    """A provider the planner set aside (spec.plan.spares): it runs no stage, and takes over the
    stage of a lost provider whose memory it holds (`ravnest.run.elastic.spare_for`)."""

    name: str
    provider: int
    ram_gb: float


@dataclass(frozen=True)
class Plan:
    clusters: tuple[ClusterPlan, ...]
    nodes: tuple[NodePlan, ...]
    rings: tuple[RingPlan, ...]
    model_bytes: int
    memory_bytes: int
    samples_per_second: float
    fingerprint: str = field(default="")
    kept_whole: tuple[tuple[str, str], ...] = ()
    """(qualified name, why) of each submodule kept whole as one layer (marked as a leaf, or not
    traceable by torch.fx); left out of the JSON when there is none, so such plans and their
    fingerprints are what they were before it existed."""
    spares: tuple[SparePlan, ...] = ()
    """The providers set aside as hot spares, by provider; left out of the JSON when there is
    none (as `kept_whole`)."""
    planned_clusters: int = 0
    """How many clusters the plan had when the job started, when clusters were added to it since
    (`growth.grow`: the clusters from this id on joined a running job); 0 (left out of the
    JSON): all of them. The fingerprint stays the planned one's: it names the job's model."""

    @property
    def planned(self) -> int:
        """The clusters planned when the job started (the data is sharded over as many)."""
        return self.planned_clusters or len(self.clusters)

    def grown(self, cluster: int) -> bool:
        """Whether `cluster` was added to the running job (`growth.grow`)."""
        return cluster >= self.planned

    def node(self, name: str) -> NodePlan:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node {name!r} in the plan (nodes: {', '.join(self.names())})")

    def names(self) -> list[str]:
        return [n.name for n in self.nodes]

    def cluster_nodes(self, cluster: int) -> list[NodePlan]:
        return [self.node(n) for n in self.clusters[cluster].nodes]

    def neighbours(self, name: str) -> tuple[str | None, str | None]:
        """(upstream, downstream) node names of a node inside its cluster."""
        node = self.node(name)
        chain = self.clusters[node.cluster].nodes
        return (chain[node.stage - 1] if node.stage > 0 else None,
                chain[node.stage + 1] if node.stage + 1 < len(chain) else None)

    def rings_of(self, name: str) -> list[RingPlan]:
        return [r for r in self.rings if name in r.members]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if not self.kept_whole:
            del d["kept_whole"]
        if not self.spares:
            del d["spares"]
        if not self.planned_clusters:
            del d["planned_clusters"]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        return cls(
            clusters=tuple(ClusterPlan(c["id"], tuple(c["nodes"]), c["seconds_per_batch"])
                           for c in d["clusters"]),
            nodes=tuple(NodePlan(**{**n, "state": tuple(n["state"])}) for n in d["nodes"]),
            rings=tuple(RingPlan(r["id"], tuple(r["members"]), tuple(r["state"]))
                        for r in d["rings"]),
            model_bytes=d["model_bytes"], memory_bytes=d["memory_bytes"],
            samples_per_second=d["samples_per_second"], fingerprint=d.get("fingerprint", ""),
            kept_whole=tuple((str(k[0]), str(k[1])) for k in d.get("kept_whole", ())),
            spares=tuple(SparePlan(str(s["name"]), int(s["provider"]), float(s["ram_gb"]))
                         for s in d.get("spares", ())),
            planned_clusters=int(d.get("planned_clusters", 0)),
        )

    def joined(self, node: NodePlan, rings: tuple[str, ...]) -> Plan:
        """This plan with `node`, of a cluster added to the running job (the next cluster, or
        one added already), appended to its cluster and to the `rings` named."""
        clusters = list(self.clusters)
        if node.cluster == len(clusters):
            clusters.append(ClusterPlan(node.cluster, (), 0.0))
        c = clusters[node.cluster]
        stages = {n: self.node(n).stage for n in c.nodes} | {node.name: node.stage}
        clusters[node.cluster] = replace(c, nodes=tuple(sorted(stages, key=stages.__getitem__)))
        return replace(self, clusters=tuple(clusters), nodes=(*self.nodes, node),
                       planned_clusters=self.planned,
                       rings=tuple(replace(r, members=(*r.members, node.name))
                                   if r.id in rings and node.name not in r.members else r
                                   for r in self.rings))

    def spare(self, name: str) -> SparePlan:
        for s in self.spares:
            if s.name == name:
                return s
        raise KeyError(f"no spare {name!r} in the plan")

    def summary(self) -> str:
        """One line: clusters x stages."""
        stages = sorted({len(c.nodes) for c in self.clusters})
        return f"{len(self.clusters)}x{'/'.join(map(str, stages))}"

    def table(self) -> str:
        """The plan as a readable table, one row per node."""
        head = ("CLUSTER", "NODE", "ROLE", "STAGE LAYERS", "PARAMS", "MEMORY", "RAM",
                "RINGS")
        rows = []
        for c in self.clusters:
            for name in c.nodes:
                n = self.node(name)
                layers = (f"{n.first_layer}..{n.last_layer} ({n.end - n.start})"
                          if n.end - n.start > 1 else n.first_layer)
                rings = ",".join(r.id for r in self.rings_of(name)) or "-"
                rows.append((str(c.id), n.name, n.role, layers, f"{n.params:,}",
                             _human(n.memory_bytes), f"{n.ram_gb:g} GB", rings))
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip()
                 for row in [head, *rows]]
        lines.append(
            f"{len(self.clusters)} cluster(s), {len(self.nodes)} node(s), "
            f"{len(self.rings)} ring(s); "
            f"model {_human(self.model_bytes)} parameters, {_human(self.memory_bytes)} to train; "
            f"estimated {self.samples_per_second:,.0f} samples/s; plan {self.fingerprint}")
        lines += [f"kept whole (one layer): {name} ({why})" for name, why in self.kept_whole]
        lines += [f"spare: {s.name} ({s.ram_gb:g} GB), runs no stage; takes over a lost "
                  f"provider's stage that fits {s.ram_gb:g} GB" for s in self.spares]
        return "\n".join(lines)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def as_planned(plan: Plan) -> Plan:
    """The plan as it was when the job started: without the clusters added to it since
    (`Plan.planned_clusters`), their nodes, and their members of the rings."""
    if not plan.planned_clusters:
        return plan
    clusters = plan.clusters[:plan.planned]
    names = {n for c in clusters for n in c.nodes}
    return replace(plan, clusters=clusters, planned_clusters=0,
                   nodes=tuple(n for n in plan.nodes if n.name in names),
                   rings=tuple(replace(r, members=tuple(m for m in r.members if m in names))
                               for r in plan.rings))


def fingerprint(plan: Plan, identity: dict[str, Any]) -> str:
    """Hash of the plan's content and of what defines the model and data (`identity`); of a
    plan that grew, the hash of the plan as it was planned (`as_planned`)."""
    body = {"plan": replace(as_planned(plan), fingerprint="").to_dict(), "identity": identity}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]
