"""The planner: group providers into clusters and split the model into stages per cluster.

All stage, cluster and ring arithmetic lives here, in one validated place, and the result is a
deterministic, JSON-serialisable `Plan`.

Cost model (per microbatch, per stage): compute time = 3 x forward FLOPs / (compute x REF_FLOPS)
(forward + backward), plus the time to send the activations that cross its downstream cut (and the
gradients back) over the slower of the two links. A cluster's time per batch is the pipeline bound
(m + S - 1) x the slowest stage for m microbatches and S stages. Memory per stage = parameters x
(weights + gradients + optimizer slots) + buffers + activations of the microbatches in flight.

Cluster formation searches the number of clusters (unless the spec fixes it) and the assignment
of providers to clusters, minimising the estimated time of the slowest cluster under every
provider's memory limit, and picks the count with the best estimated throughput including the ring
all-reduce cost. Within a cluster, a dynamic program finds the contiguous split that minimises the
slowest stage's time while respecting each provider's RAM.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .errors import PlanError
from .partitioning import Profile

GB = 2**30
REF_FLOPS = 20e9
"""FLOP/s of a provider with compute 1.0."""
DEFAULT_BANDWIDTH_MBPS = 1000.0
OPTIMIZER_SLOTS = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adagrad": 1,
                   "RMSprop": 2, "SGD": 1, "Adadelta": 2, "ASGD": 2, "Rprop": 2, "LBFGS": 2}


@dataclass(frozen=True)
class ProviderInfo:
    ram_gb: float
    bandwidth_mbps: float | None = None
    compute: float = 1.0

    @property
    def bytes_per_second(self) -> float:
        return (self.bandwidth_mbps or DEFAULT_BANDWIDTH_MBPS) * 1e6 / 8


@dataclass(frozen=True)
class Workload:
    """How the model is trained: what the cost model needs beyond the profile."""

    batch_size: int = 64
    microbatches: int = 1
    max_in_flight: int = 4
    optimizer: str = "Adam"
    reduce_factor: int = 1


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


@dataclass(frozen=True)
class Plan:
    clusters: tuple[ClusterPlan, ...]
    nodes: tuple[NodePlan, ...]
    rings: tuple[RingPlan, ...]
    model_bytes: int
    memory_bytes: int
    samples_per_second: float
    fingerprint: str = field(default="")

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
        return asdict(self)

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
        )

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
        return "\n".join(lines)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


class _Costs:
    """Prefix sums over a profile, scaled to one microbatch."""

    def __init__(self, profile: Profile, work: Workload) -> None:
        self.profile = profile
        self.n = len(profile.layers)
        mb = max(1, math.ceil(work.batch_size / work.microbatches))
        scale = mb / profile.example_batch
        slots = OPTIMIZER_SLOTS.get(work.optimizer, 2)
        in_flight = min(work.max_in_flight, work.microbatches)
        self.flops = _prefix(3 * layer.flops * scale for layer in profile.layers)
        self.mem = _prefix(layer.param_bytes * (2 + slots) + layer.buffer_bytes
                           + layer.out_bytes * scale * in_flight for layer in profile.layers)
        self.cut = [b * scale for b in profile.cut_bytes]
        self.params = _prefix(layer.param_bytes for layer in profile.layers)
        self.microbatches = work.microbatches
        self.mb = mb

    def stage_memory(self, i: int, j: int) -> float:
        return self.mem[j] - self.mem[i]

    def stage_time(self, i: int, j: int, p: ProviderInfo, nxt: ProviderInfo | None) -> float:
        t = (self.flops[j] - self.flops[i]) / (p.compute * REF_FLOPS)
        if nxt is not None:
            t += 2 * self.cut[j - 1] / min(p.bytes_per_second, nxt.bytes_per_second)
        return t

    @property
    def total_memory(self) -> float:
        return self.mem[-1]


def _prefix(values: Any) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def split_cluster(costs: _Costs, providers: Sequence[ProviderInfo]) -> tuple[list[int], float]:
    """Best contiguous split of the layers over ordered providers.

    Returns the stage boundaries (len(providers)+1 indices into the layers) and the slowest
    stage's seconds per microbatch; raises PlanError when no split fits in memory.
    """
    n, s = costs.n, len(providers)
    allowed = [0] + [i + 1 for i, ok in enumerate(costs.profile.cut_ok) if ok] + [n]
    allowed = sorted(set(allowed))
    if s > len(allowed) - 1:
        raise PlanError(f"a cluster of {s} providers needs {s} stages but the model can be cut "
                        f"into at most {len(allowed) - 1} (more stages than layers); use fewer "
                        "providers per cluster or more clusters")
    inf = math.inf
    index = {b: k for k, b in enumerate(allowed)}
    # best[st][k]: (slowest stage, sum of squared stage times) of the first st stages ending at
    # allowed[k]; the second term breaks ties towards balanced stages.
    best = [[(inf, inf)] * len(allowed) for _ in range(s + 1)]
    back = [[-1] * len(allowed) for _ in range(s + 1)]
    best[0][0] = (0.0, 0.0)
    for st in range(1, s + 1):
        p = providers[st - 1]
        nxt = providers[st] if st < s else None
        cap = p.ram_gb * GB
        for kj in range(st, len(allowed)):
            j = allowed[kj]
            if st == s and j != n:
                continue
            for ki in range(st - 1, kj):
                prev = best[st - 1][ki]
                if prev[0] == inf:
                    continue
                i = allowed[ki]
                if costs.stage_memory(i, j) > cap:
                    continue
                t = costs.stage_time(i, j, p, nxt)
                cand = (max(prev[0], t), prev[1] + t * t)
                if cand < best[st][kj]:
                    best[st][kj], back[st][kj] = cand, ki
    if best[s][index[n]][0] == inf:
        need = costs.total_memory / GB
        have = sum(p.ram_gb for p in providers)
        raise PlanError(f"a cluster with {have:.3g} GB of RAM over {s} provider(s) cannot hold the "
                        f"model ({need:.3g} GB to train, and each stage must fit its provider)")
    bounds = [n]
    k = index[n]
    for st in range(s, 0, -1):
        k = back[st][k]
        bounds.append(allowed[k])
    return bounds[::-1], best[s][index[n]][0]


def _cluster_time(costs: _Costs, providers: Sequence[ProviderInfo]) -> float:
    try:
        _, t = split_cluster(costs, providers)
    except PlanError:
        return math.inf
    return (costs.microbatches + len(providers) - 1) * t


def _ring_seconds(costs: _Costs, groups: list[list[int]], pool: Sequence[ProviderInfo],
                  reduce_factor: int) -> float:
    k = len(groups)
    if k == 1:
        return 0.0
    slowest = min(p.bytes_per_second for p in pool)
    return 2 * (k - 1) / k * costs.params[-1] / slowest / reduce_factor


def _assign(costs: _Costs, pool: Sequence[ProviderInfo], k: int) -> list[list[int]]:
    """Assign providers to k clusters, then improve by moves and swaps."""
    order = sorted(range(len(pool)), key=lambda i: (-pool[i].compute, -pool[i].ram_gb, i))
    groups: list[list[int]] = [[] for _ in range(k)]
    for pos, i in enumerate(order):
        lap, r = divmod(pos, k)
        groups[r if lap % 2 == 0 else k - 1 - r].append(i)
    groups = [sorted(g) for g in groups]

    def score(gs: list[list[int]]) -> tuple[float, float]:
        times = [_cluster_time(costs, [pool[i] for i in g]) if g else math.inf for g in gs]
        infeasible = sum(1 for t in times if t == math.inf)
        finite = [t for t in times if t != math.inf]
        return (infeasible, max(finite) if finite and not infeasible else 0.0)

    current = score(groups)
    for _ in range(4 * len(pool)):
        improved = False
        for a in range(k):
            for b in range(k):
                if a == b:
                    continue
                for x in list(groups[a]):
                    trial = [list(g) for g in groups]
                    if len(trial[a]) > 1:
                        trial[a].remove(x)
                        trial[b] = sorted([*trial[b], x])
                        s = score(trial)
                        if s < current:
                            groups, current, improved = trial, s, True
                            break
                    for y in groups[b]:
                        trial = [list(g) for g in groups]
                        trial[a][trial[a].index(x)] = y
                        trial[b][trial[b].index(y)] = x
                        trial = [sorted(g) for g in trial]
                        s = score(trial)
                        if s < current:
                            groups, current, improved = trial, s, True
                            break
                    if improved:
                        break
                if improved:
                    break
            if improved:
                break
        if not improved:
            break
    return sorted(groups, key=lambda g: g[0])


def make_plan(profile: Profile, pool: Sequence[ProviderInfo], work: Workload,
              clusters: int | None = None, max_clusters: int | None = None,
              identity: dict[str, Any] | None = None) -> Plan:
    """Plan clusters, stages and rings; `identity` (model/data spec) goes into the fingerprint."""
    if not pool:
        raise PlanError("spec.providers: at least one provider is needed")
    costs = _Costs(profile, work)
    total_ram = sum(p.ram_gb for p in pool)
    if total_ram * GB < costs.total_memory:
        raise PlanError(
            f"spec.providers: total RAM {total_ram:.3g} GB is below the model's training memory "
            f"{costs.total_memory / GB:.3g} GB (parameters, gradients, optimizer state and "
            "activations); add providers or RAM")
    if clusters is not None and clusters > len(pool):
        raise PlanError(f"spec.plan.clusters: {clusters} clusters need at least {clusters} "
                        f"providers, got {len(pool)}")
    candidates = [clusters] if clusters else list(range(1, min(len(pool), max_clusters or
                                                                len(pool)) + 1))
    best: tuple[float, list[list[int]]] | None = None
    for k in candidates:
        groups = _assign(costs, pool, k)
        times = [_cluster_time(costs, [pool[i] for i in g]) for g in groups]
        if any(t == math.inf for t in times):
            continue
        seconds = max(times) + _ring_seconds(costs, groups, pool, work.reduce_factor)
        throughput = k * work.batch_size / seconds if seconds > 0 else math.inf
        if best is None or throughput > best[0] * (1 + 1e-9):
            best = (throughput, groups)
    if best is None:
        k = candidates[0]
        groups = _assign(costs, pool, k)
        for g in groups:
            split_cluster(costs, [pool[i] for i in g])
        raise PlanError(f"no way to form {k} cluster(s) that each hold the model")
    return _build(profile, costs, pool, best[1], best[0], identity or {})


def _build(profile: Profile, costs: _Costs, pool: Sequence[ProviderInfo], groups: list[list[int]],
           throughput: float, identity: dict[str, Any]) -> Plan:
    nodes: list[NodePlan] = []
    cluster_plans = []
    for cid, group in enumerate(groups):
        providers = [pool[i] for i in group]
        bounds, slowest = split_cluster(costs, providers)
        names = []
        for st, idx in enumerate(group):
            i, j = bounds[st], bounds[st + 1]
            s = len(group)
            role = ("root-leaf" if s == 1 else "root" if st == 0 else
                    "leaf" if st == s - 1 else "stem")
            layers = profile.layers[i:j]
            nxt = providers[st + 1] if st + 1 < s else None
            nodes.append(NodePlan(
                name=f"node_{idx}", provider=idx, cluster=cid, stage=st, role=role, start=i, end=j,
                first_layer=layers[0].name, last_layer=layers[-1].name,
                state=tuple(x for layer in layers for x in layer.state),
                params=sum(layer.params for layer in layers),
                memory_bytes=int(costs.stage_memory(i, j)), ram_gb=pool[idx].ram_gb,
                seconds_per_microbatch=costs.stage_time(i, j, pool[idx], nxt)))
            names.append(f"node_{idx}")
        cluster_plans.append(ClusterPlan(cid, tuple(names),
                                         (costs.microbatches + len(group) - 1) * slowest))
    nodes.sort(key=lambda n: n.provider)
    rings = _rings(profile, nodes, len(groups))
    plan = Plan(clusters=tuple(cluster_plans), nodes=tuple(nodes), rings=tuple(rings),
                model_bytes=int(costs.params[-1]), memory_bytes=int(costs.total_memory),
                samples_per_second=round(throughput, 3))
    return replace(plan, fingerprint=fingerprint(plan, identity))


def fingerprint(plan: Plan, identity: dict[str, Any]) -> str:
    """Hash of the plan's content and of what defines the model and data (`identity`)."""
    body = {"plan": replace(plan, fingerprint="").to_dict(), "identity": identity}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _rings(profile: Profile, nodes: list[NodePlan], k: int) -> list[RingPlan]:
    if k < 2:
        return []
    owner: dict[tuple[int, str], str] = {}
    for n in nodes:
        for s in n.state:
            owner[(n.cluster, s)] = n.name
    owned = {name for layer in profile.layers for name in layer.state}
    groups: dict[tuple[str, ...], list[str]] = {}
    for name in profile.state_names:
        if name not in owned:
            continue
        members = tuple(owner[(c, name)] for c in range(k))
        groups.setdefault(members, []).append(name)
    return [RingPlan(id=f"ring{i}", members=m, state=tuple(s))
            for i, (m, s) in enumerate(groups.items())]
