"""The planner: group providers into clusters and split the model into stages per cluster.

All stage, cluster and ring arithmetic lives here, in one validated place, and the result is a
deterministic, JSON-serialisable `Plan`.

Cost model (per microbatch, per stage): compute time = 3 x forward FLOPs / (compute x REF_FLOPS)
(forward + backward), plus the time to send the activations that cross its downstream cut (and the
gradients back) over the slower of the two links. A cluster's time per batch is the pipeline bound
(m + S - 1) x the slowest stage for m microbatches and S stages. Memory per stage = parameters x
(weights + gradients + optimizer slots) + buffers + activations of the microbatches in flight.
A step (every cluster trains one batch) adds the ring all-reduce of all parameters over k
clusters, 2 (k - 1) / k x parameter bytes at the slowest provider's bandwidth, divided by the
reduce factor.

Cluster formation uses every provider. For each candidate number of clusters (all of them for
small pools, a geometric grid refined by bisection for large ones, skipping counts whose upper
bound cannot beat the best so far) a local search moves or swaps providers out of the slowest
cluster, minimising the estimated time of the slowest cluster under every provider's memory
limit; the count with the best estimated throughput, ring all-reduce included, wins. Within a
cluster, providers are ordered by link speed (both ways are tried) and a vectorised dynamic
program finds the contiguous split that minimises the slowest stage's time while respecting each
provider's RAM. `estimate` scores any grouping and split with the same cost model.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from ravnest.errors import PlanError
from ravnest.plan.partitioning import Profile

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

    def successor(self, name: str) -> str:
        """The member `name` sends its pieces to (itself in a ring of one)."""
        return self.members[(self.members.index(name) + 1) % len(self.members)]


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
    """Prefix sums over a profile, scaled to one microbatch, and the same figures as matrices over
    the allowed cuts (`allowed`), for the vectorised split."""

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
        self.batch_size = work.batch_size
        self.reduce_factor = work.reduce_factor
        self.mb = mb
        self.allowed = sorted({0, self.n} | {i + 1 for i, ok in enumerate(profile.cut_ok) if ok})
        at = np.array(self.allowed)
        flops, mem = np.array(self.flops)[at], np.array(self.mem)[at]
        ahead = np.triu(np.ones((len(at), len(at)), dtype=bool), 1)
        self.d_seconds = np.where(ahead, (flops[None, :] - flops[:, None]) / REF_FLOPS, math.inf)
        """d_seconds[a, b]: seconds at compute 1.0 of the stage from allowed[a] to allowed[b]
        (infinite unless a < b)."""
        self.d_mem = mem[None, :] - mem[:, None]
        self.cut_at = np.array([self.cut[j - 1] if 0 < j < self.n else 0.0 for j in self.allowed])
        self._stage: dict[tuple[float, float], Any] = {}

    def compute_matrix(self, p: ProviderInfo) -> Any:
        """Compute seconds of every possible stage on provider p, infinite where it does not fit
        p's RAM (cached per compute and RAM)."""
        key = (p.compute, p.ram_gb)
        m = self._stage.get(key)
        if m is None:
            m = self._stage[key] = np.where(self.d_mem <= p.ram_gb * GB,
                                            self.d_seconds / p.compute, math.inf)
        return m

    def stage_memory(self, i: int, j: int) -> float:
        return self.mem[j] - self.mem[i]

    def stage_time(self, i: int, j: int, p: ProviderInfo, nxt: ProviderInfo | None) -> float:
        t = (self.flops[j] - self.flops[i]) / REF_FLOPS / p.compute
        if nxt is not None:
            t += self.cut[j - 1] * (2 / min(p.bytes_per_second, nxt.bytes_per_second))
        return t

    def cluster_seconds(self, stages: int, slowest: float) -> float:
        """Seconds per batch of a pipeline: (m + S - 1) x its slowest stage."""
        return (self.microbatches + stages - 1) * slowest

    def ring_seconds(self, clusters: int, slowest: float) -> float:
        """Ring all-reduce of all parameters per step over `clusters` replicas, at `slowest`
        bytes/s, divided by the reduce factor."""
        if clusters < 2:
            return 0.0
        return 2 * (clusters - 1) / clusters * self.params[-1] / slowest / self.reduce_factor

    @property
    def total_memory(self) -> float:
        return self.mem[-1]


def _prefix(values: Any) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def _too_many_stages(costs: _Costs, s: int) -> PlanError:
    return PlanError(f"a cluster of {s} providers needs {s} stages but the model can be cut "
                     f"into at most {len(costs.allowed) - 1} (more stages than layers); use fewer "
                     "providers per cluster or more clusters")


def _min_max_split(costs: _Costs, providers: Sequence[ProviderInfo],
                   backtrack: bool) -> tuple[float, list[Any]]:
    """The dynamic program over allowed cuts, one stage (provider) at a time, vectorised.

    best[b]: the slowest stage of the best split of the layers before allowed[b] over the
    providers so far; with `backtrack`, ties go to the smaller sum of squared stage times
    (balanced stages) and the chosen predecessors are kept for `split_cluster`.
    """
    s, width = len(providers), len(costs.allowed)
    best = np.full(width, math.inf)
    best[0] = 0.0
    squares = best.copy()
    back: list[Any] = []
    for st, p in enumerate(providers):
        t = costs.compute_matrix(p)
        if st + 1 < s:
            t = t + costs.cut_at * (2 / min(p.bytes_per_second, providers[st + 1].bytes_per_second))
        cand = np.maximum(best[:, None], t)
        new = cand.min(axis=0)
        if backtrack:
            tied = np.where(cand == new, squares[:, None] + t * t, math.inf)
            pick = tied.argmin(axis=0)
            squares = tied[pick, np.arange(width)]
            back.append(pick)
        best = new
    return float(best[-1]), back


def split_cluster(costs: _Costs, providers: Sequence[ProviderInfo]) -> tuple[list[int], float]:
    """Best contiguous split of the layers over ordered providers.

    Returns the stage boundaries (len(providers)+1 indices into the layers) and the slowest
    stage's seconds per microbatch; raises PlanError when no split fits in memory.
    """
    s = len(providers)
    if s > len(costs.allowed) - 1:
        raise _too_many_stages(costs, s)
    slowest, back = _min_max_split(costs, providers, backtrack=True)
    if slowest == math.inf:
        need = costs.total_memory / GB
        have = sum(p.ram_gb for p in providers)
        raise PlanError(f"a cluster with {have:.3g} GB of RAM over {s} provider(s) cannot hold the "
                        f"model ({need:.3g} GB to train, and each stage must fit its provider)")
    k = len(costs.allowed) - 1
    bounds = [costs.n]
    for st in range(s - 1, -1, -1):
        k = int(back[st][k])
        bounds.append(costs.allowed[k])
    return bounds[::-1], slowest


def _ring_seconds(costs: _Costs, groups: Sequence[Sequence[int]],
                  pool: Sequence[ProviderInfo]) -> float:
    """Ring all-reduce per step: 2 (k-1)/k x parameter bytes over the slowest provider used."""
    return costs.ring_seconds(len(groups), min(pool[i].bytes_per_second for g in groups for i in g))


def _pair_better(new: tuple[float, float], old: tuple[float, float]) -> bool:
    """Whether two clusters' new times beat the old ones, slowest first (by more than noise)."""
    hi_n, lo_n = max(new), min(new)
    hi_o, lo_o = max(old), min(old)
    if hi_n < hi_o * (1 - 1e-9):
        return True
    return hi_n <= hi_o and lo_n < lo_o * (1 - 1e-9)


class _Search:
    """Cluster formation for a pool: cached cluster times and a local search per cluster count.

    A cluster's time is its best pipeline over two orders of its providers (fastest link first,
    and slowest first), split by the dynamic program; times are cached by member set, so the
    search mostly looks up what it has seen.
    """

    def __init__(self, costs: _Costs, pool: Sequence[ProviderInfo]) -> None:
        self.costs, self.pool = costs, pool
        self.cache: dict[tuple[int, ...], tuple[float, tuple[int, ...]]] = {}
        self.evaluations = 0

    def cluster(self, members: tuple[int, ...]) -> tuple[float, tuple[int, ...]]:
        """(seconds per batch, members in pipeline order) of the best pipeline of `members`."""
        hit = self.cache.get(members)
        if hit is not None:
            return hit
        pool, costs = self.pool, self.costs
        best: tuple[float, tuple[int, ...]] = (math.inf, members)
        if len(members) < len(costs.allowed):
            fast = tuple(sorted(members, key=lambda i: (-pool[i].bytes_per_second, i)))
            slow = tuple(sorted(members, key=lambda i: (pool[i].bytes_per_second, i)))
            for order in (fast, slow) if slow != fast else (fast,):
                self.evaluations += 1
                slowest, _ = _min_max_split(costs, [pool[i] for i in order], backtrack=False)
                t = costs.cluster_seconds(len(order), slowest)
                if t < best[0]:
                    best = (t, order)
        self.cache[members] = best
        return best

    def time(self, members: tuple[int, ...]) -> float:
        return self.cluster(members)[0]

    def deal(self, k: int) -> list[tuple[int, ...]]:
        """k clusters dealt back and forth from the providers, strongest first."""
        pool = self.pool
        order = sorted(range(len(pool)), key=lambda i: (-pool[i].compute, -pool[i].ram_gb,
                                                        -pool[i].bytes_per_second, i))
        groups: list[list[int]] = [[] for _ in range(k)]
        for pos, i in enumerate(order):
            lap, r = divmod(pos, k)
            groups[r if lap % 2 == 0 else k - 1 - r].append(i)
        return [tuple(sorted(g)) for g in groups]

    def improve(self, groups: list[tuple[int, ...]], budget: int) -> list[tuple[int, ...]]:
        """Relieve the slowest cluster (move a provider in or out, or swap one) while that helps,
        within `budget` new cluster evaluations."""
        groups = list(groups)
        times = [self.time(g) for g in groups]
        stop = self.evaluations + budget
        while self.evaluations < stop:
            a = min(range(len(groups)), key=lambda c: (-times[c], c))
            found = self._relieve(groups, times, a, stop)
            if found is None:
                break
            (b, ga, gb) = found
            groups[a], groups[b] = ga, gb
            times[a], times[b] = self.time(ga), self.time(gb)
        return groups

    def _relieve(self, groups: list[tuple[int, ...]], times: list[float], a: int,
                 stop: int) -> tuple[int, tuple[int, ...], tuple[int, ...]] | None:
        """The first move into or out of cluster `a`, or swap with another cluster, that improves
        the pair (trying the fastest partners first)."""
        partners = sorted((c for c in range(len(groups)) if c != a), key=lambda c: (times[c], c))
        members = groups[a]
        for b in partners:
            old = (times[a], times[b])
            trials = []
            if len(groups[b]) > 1:  # pull one of b's providers into a
                for y in groups[b]:
                    ga = tuple(sorted((*members, y)))
                    if self.time(ga) < times[a]:
                        trials.append((ga, tuple(i for i in groups[b] if i != y)))
            for x in members:
                rest = tuple(i for i in members if i != x)
                if rest and self.time(rest) < times[a]:  # push x into b
                    trials.append((rest, tuple(sorted((*groups[b], x)))))
                for y in groups[b]:  # swap x and y
                    ga = tuple(sorted((*rest, y)))
                    if self.time(ga) < times[a]:
                        trials.append((ga, tuple(sorted(i if i != y else x for i in groups[b]))))
            for ga, gb in trials:
                if _pair_better((self.time(ga), self.time(gb)), old):
                    return b, ga, gb
            if self.evaluations >= stop:
                return None
        return None

    def plan(self, k: int, budget: int) -> tuple[float, list[tuple[int, ...]]]:
        """(estimated samples/s, clusters) for k clusters after `budget` evaluations of search."""
        groups = self.improve(self.deal(k), budget)
        times = [self.time(g) for g in groups]
        if math.inf in times:
            return 0.0, groups
        seconds = max(times) + _ring_seconds(self.costs, groups, self.pool)
        return (k * self.costs.batch_size / seconds if seconds > 0 else math.inf), groups


def _cluster_counts(lo: int, hi: int) -> list[int]:
    """Cluster counts to try first: all of them when few, else a geometric grid from lo to hi."""
    if hi - lo < 16:
        return list(range(lo, hi + 1))
    ratio = (hi / lo) ** (1 / 12)
    grid = {lo, hi}
    k = float(lo)
    while k < hi:
        grid.add(round(k))
        k *= ratio
    return sorted(g for g in grid if lo <= g <= hi)


def _upper_bound(costs: _Costs, pool: Sequence[ProviderInfo], k: int) -> float:
    """Samples/s that no plan of k clusters (every provider used) can beat.

    The largest cluster has at least ceil(n/k) stages; its slowest stage takes at least the
    model's compute over the fastest providers' summed compute, and when it has two stages or
    more, one of them sends the smallest cut over the fastest link.
    """
    n = len(pool)
    size = math.ceil(n / k)
    deepest = min(n, len(costs.allowed) - 1)
    fastest = sum(sorted((p.compute for p in pool), reverse=True)[:deepest])
    stage = costs.flops[-1] / REF_FLOPS / fastest
    inner = costs.cut_at[1:-1]
    if size > 1 and len(inner):
        stage = max(stage, float(inner.min()) * 2 / max(p.bytes_per_second for p in pool))
    seconds = costs.cluster_seconds(size, stage) + costs.ring_seconds(
        k, min(p.bytes_per_second for p in pool))
    return k * costs.batch_size / seconds if seconds > 0 else math.inf


def make_plan(profile: Profile, pool: Sequence[ProviderInfo], work: Workload,
              clusters: int | None = None, max_clusters: int | None = None,
              identity: dict[str, Any] | None = None) -> Plan:
    """Plan clusters, stages and rings; `identity` (model/data spec) goes into the fingerprint.

    Every provider is used. Each candidate cluster count gets a short local search (all counts
    for small pools; for large ones a geometric grid, refined around the best by bisection),
    skipping counts whose upper bound cannot beat the best so far; the best count then gets a
    longer search. Deterministic: no randomness, and budgets count evaluations, not seconds.
    """
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
    n = len(pool)
    search = _Search(costs, pool)
    quick, full = 4 * n + 100, 20 * n + 200
    if clusters:
        lo = hi = clusters
    else:
        hi = min(n, max_clusters or n, max(1, int(total_ram * GB // costs.total_memory)))
        lo = min(hi, math.ceil(n / (len(costs.allowed) - 1)))
    scored: dict[int, float] = {}
    tried: set[int] = set()

    def consider(k: int) -> None:
        tried.add(k)
        if _upper_bound(costs, pool, k) > max(scored.values(), default=0.0):
            scored[k] = search.plan(k, quick)[0]

    def ranking() -> list[int]:
        """Counts tried, best first (ties: fewer clusters)."""
        return sorted(scored, key=lambda k: (-round(scored[k], 9), k))

    for k in sorted(_cluster_counts(lo, hi), key=lambda k: (-_upper_bound(costs, pool, k), k)):
        consider(k)
    while True:  # bisect the gaps next to the best count
        ks, top = sorted(tried), ranking()[0]
        pos = ks.index(top)
        gaps = [(ks[p] + top) // 2 for p in (pos - 1, pos + 1)
                if 0 <= p < len(ks) and abs(ks[p] - top) > 1]
        if not gaps:
            break
        for k in gaps:
            consider(k)
    finalists = [k for k in ranking()[:3] if scored[k] > 0]
    if not finalists:
        k = lo
        for g in search.deal(k):
            split_cluster(costs, [pool[i] for i in g])
        raise PlanError(f"no way to form {k} cluster(s) that each hold the model")
    throughput, groups = max((search.plan(k, full) for k in finalists),
                             key=lambda r: (round(r[0], 9), -len(r[1])))
    ordered = sorted((search.cluster(g)[1] for g in groups), key=min)
    return _build(profile, costs, pool, ordered, throughput, identity or {})


@dataclass(frozen=True)
class Estimate:
    """What the cost model says about one grouping and split (see `estimate`)."""

    cluster_seconds: tuple[float, ...]
    """Per cluster, seconds per batch: (microbatches + stages - 1) x its slowest stage."""
    ring_seconds: float
    """Ring all-reduce seconds per optimizer step, divided by the reduce factor."""
    step_seconds: float
    """Slowest cluster plus ring: one step, in which every cluster trains one batch."""
    samples_per_second: float
    overflows: tuple[str, ...]
    """One line per stage whose memory exceeds its provider's RAM (the time ignores it)."""

    @property
    def fits(self) -> bool:
        return not self.overflows


def estimate(profile: Profile, pool: Sequence[ProviderInfo], work: Workload,
             clusters: Sequence[Sequence[int]],
             bounds: Sequence[Sequence[int]] | None = None) -> Estimate:
    """Score any grouping and split with the planner's cost model.

    `clusters[c]` lists provider indices (into `pool`) in pipeline order; `bounds[c]` the stage
    boundaries of cluster c as layer indices (0, ..., len(profile.layers)), one more than its
    providers, cutting only where the model may be cut. Without `bounds`, each cluster gets the
    planner's split of its providers in the order given. Providers may be left out.
    """
    costs = _Costs(profile, work)
    seen: set[int] = set()
    for c, members in enumerate(clusters):
        if not members:
            raise PlanError(f"clusters[{c}]: a cluster needs at least one provider")
        for i in members:
            if not 0 <= i < len(pool) or i in seen:
                raise PlanError(f"clusters[{c}]: provider {i} is out of range or in two clusters")
            seen.add(i)
    if not clusters:
        raise PlanError("clusters: at least one cluster is needed")
    if bounds is not None and len(bounds) != len(clusters):
        raise PlanError(f"bounds: one list per cluster, got {len(bounds)} for {len(clusters)}")
    allowed = set(costs.allowed)
    times, overflows = [], []
    for c, members in enumerate(clusters):
        providers = [pool[i] for i in members]
        if bounds is None:
            cut, _ = split_cluster(costs, providers)
        else:
            cut = list(bounds[c])
            if (len(cut) != len(members) + 1 or cut[0] != 0 or cut[-1] != costs.n
                    or any(a >= b for a, b in itertools.pairwise(cut))
                    or not set(cut) <= allowed):
                raise PlanError(f"bounds[{c}]: {cut} must run from 0 to {costs.n} in "
                                f"{len(members)} non-empty stages, cutting only at {costs.allowed}")
        stage = []
        for st, p in enumerate(providers):
            nxt = providers[st + 1] if st + 1 < len(providers) else None
            stage.append(costs.stage_time(cut[st], cut[st + 1], p, nxt))
            need = costs.stage_memory(cut[st], cut[st + 1])
            if need > p.ram_gb * GB:
                overflows.append(f"cluster {c} stage {st} (provider {members[st]}): "
                                 f"{need / GB:.3g} GB > {p.ram_gb:g} GB")
        times.append(costs.cluster_seconds(len(providers), max(stage)))
    ring = _ring_seconds(costs, clusters, pool)
    step = max(times) + ring
    return Estimate(tuple(times), ring, step, len(clusters) * work.batch_size / step,
                    tuple(overflows))


def _build(profile: Profile, costs: _Costs, pool: Sequence[ProviderInfo],
           groups: Sequence[Sequence[int]], throughput: float, identity: dict[str, Any]) -> Plan:
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
                                         costs.cluster_seconds(len(group), slowest)))
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
