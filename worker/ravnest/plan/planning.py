"""The planner: group providers into clusters and split the model into stages per cluster.

All stage, cluster and ring arithmetic lives here and in `costs`, and the result is a
deterministic, JSON-serialisable `plans.Plan`.

Cluster formation uses every provider but those set aside as hot spares (spec.plan.spares). For
each candidate number of clusters (all of them for small pools, a geometric grid refined by
bisection for large ones, skipping counts whose upper bound cannot beat the best so far) a local
search moves or swaps providers out of the slowest cluster, minimising the estimated time of the
slowest cluster under every provider's memory limit; the count with the best estimated throughput,
ring all-reduce included, wins. Within a cluster, providers are ordered by link speed (both ways
are tried) and a vectorised dynamic program finds the contiguous split that minimises the slowest
stage's time while respecting each provider's RAM. `estimate` scores any grouping and split with
the same cost model (`costs`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ravnest.errors import PlanError
from ravnest.plan.costs import REF_FLOPS, Costs, Workload
from ravnest.plan.partitioning import Profile
from ravnest.plan.plans import (
    GB,
    ClusterPlan,
    NodePlan,
    Plan,
    ProviderInfo,
    RingPlan,
    SparePlan,
    fingerprint,
    spare_name,
)


def _too_many_stages(costs: Costs, s: int) -> PlanError:
    return PlanError(f"a cluster of {s} providers needs {s} stages but the model can be cut "
                     f"into at most {len(costs.allowed) - 1} (more stages than layers); use fewer "
                     "providers per cluster or more clusters")


def _min_max_split(costs: Costs, providers: Sequence[ProviderInfo],
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


def split_cluster(costs: Costs, providers: Sequence[ProviderInfo]) -> tuple[list[int], float]:
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


def _ring_seconds(costs: Costs, groups: Sequence[Sequence[int]],
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

    def __init__(self, costs: Costs, pool: Sequence[ProviderInfo]) -> None:
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

    def finalists(self, lo: int, hi: int, budget: int) -> list[int]:
        """Up to three cluster counts from lo to hi, best first, by a short search of each.

        Counts are tried in the order of their upper bounds, skipping those whose bound cannot
        beat the best so far; then the gaps next to the best count are bisected.
        """
        costs, pool = self.costs, self.pool
        scored: dict[int, float] = {}
        tried: set[int] = set()

        def consider(k: int) -> None:
            tried.add(k)
            if _upper_bound(costs, pool, k) > max(scored.values(), default=0.0):
                scored[k] = self.plan(k, budget)[0]

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
        return [k for k in ranking()[:3] if scored[k] > 0]


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


def _upper_bound(costs: Costs, pool: Sequence[ProviderInfo], k: int) -> float:
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


SPARE_TOLERANCE = 0.01
"""`spares: auto` sets a provider aside only while the plan without the spares is estimated at
most this much slower (a fraction of samples/s) than the plan that uses every provider."""
SPARE_CANDIDATES = 4
"""Providers tried as the next spare: the weakest of those still used (least RAM, then compute,
then bandwidth)."""
AUTO_SPARE_ROUNDS = 8
"""The most spares `spares: auto` sets aside."""
SPARE_WORK = 2000
"""`spares: auto` makes at most this many trial plans divided by the pool's providers (a plan of
n providers costs about n), and at least `SPARE_CANDIDATES`: a pool of 6 tries all it may, one of
1,000 a single round. A count makes its rounds in full (`SPARE_CANDIDATES` trials each)."""


def make_plan(profile: Profile, pool: Sequence[ProviderInfo], work: Workload,
              clusters: int | None = None, max_clusters: int | None = None,
              identity: dict[str, Any] | None = None, train_samples: int | None = None,
              spares: int | str = 0) -> Plan:
    """Plan clusters, stages and rings; `identity` (model/data spec) goes into the fingerprint.

    With `train_samples` (the training set's size), every cluster must get a batch each step: the
    planner chooses at most that many clusters, and refuses a fixed `clusters` beyond it.
    Every provider is used, but for `spares` (spec.plan.spares) set aside as hot spares: a number,
    the providers whose absence costs the least estimated throughput, one at a time; ``auto``,
    those the plan does not need (set aside while the estimate stays within `SPARE_TOLERANCE` of
    the plan with every provider: a provider that would hold a stage of no parameters, say).
    Each candidate cluster count gets a short local search (all counts for small pools; for large
    ones a geometric grid, refined around the best by bisection), skipping counts whose upper
    bound cannot beat the best so far; the best count then gets a longer search. Deterministic:
    no randomness, and budgets count evaluations, not seconds.
    """
    if not pool:
        raise PlanError("spec.providers: at least one provider is needed")
    costs = Costs(profile, work)
    if train_samples is not None:
        max_clusters = _data_clusters(work, train_samples, clusters, max_clusters)
    used = list(range(len(pool)))
    throughput, ordered = _form(costs, pool, used, clusters, max_clusters)
    aside: list[int] = []
    if spares:
        throughput, ordered, aside = _set_aside(costs, pool, clusters, max_clusters, spares,
                                                throughput, ordered)
    plan = _build(profile, costs, pool, ordered, throughput, identity or {},
                  tuple(SparePlan(spare_name(i), i, pool[i].ram_gb) for i in sorted(aside)))
    return plan


def _form(costs: Costs, pool: Sequence[ProviderInfo], used: Sequence[int], clusters: int | None,
          max_clusters: int | None) -> tuple[float, list[tuple[int, ...]]]:
    """(estimated samples/s, clusters in pipeline order, by index into `pool`) of the best plan
    over the providers `used`; PlanError when they cannot hold the model."""
    sub = [pool[i] for i in used]
    lo, hi = _cluster_range(costs, sub, clusters, max_clusters)
    n = len(sub)
    search = _Search(costs, sub)
    finalists = search.finalists(lo, hi, budget=4 * n + 100)
    if not finalists:
        for g in search.deal(lo):
            split_cluster(costs, [sub[i] for i in g])
        raise PlanError(f"no way to form {lo} cluster(s) that each hold the model")
    throughput, groups = max((search.plan(k, 20 * n + 200) for k in finalists),
                             key=lambda r: (round(r[0], 9), -len(r[1])))
    ordered = sorted((tuple(used[i] for i in search.cluster(g)[1]) for g in groups), key=min)
    return throughput, ordered


def _set_aside(costs: Costs, pool: Sequence[ProviderInfo], clusters: int | None,
               max_clusters: int | None, spares: int | str, throughput: float,
               ordered: list[tuple[int, ...]]
               ) -> tuple[float, list[tuple[int, ...]], list[int]]:
    """Set providers aside one at a time (see `make_plan`): each round tries the weakest
    `SPARE_CANDIDATES` still used and keeps the one whose absence leaves the fastest plan.
    (throughput, clusters, spares)."""
    auto = spares == "auto"
    want = AUTO_SPARE_ROUNDS if auto else int(spares)
    if not auto and want >= len(pool):
        raise PlanError(f"spec.plan.spares: {want} spare(s) leave none of the {len(pool)} "
                        f"provider(s) to train")
    floor = throughput * (1 - SPARE_TOLERANCE)
    trials = max(SPARE_CANDIDATES, SPARE_WORK // len(pool))
    aside: list[int] = []
    while len(aside) < want and (trials > 0 or not auto):
        tries = min(SPARE_CANDIDATES, trials) if auto else SPARE_CANDIDATES
        trials -= tries
        used = [i for g in ordered for i in g]
        weakest = sorted(used, key=lambda i: (pool[i].ram_gb, pool[i].compute,
                                              pool[i].bytes_per_second, i))
        best: tuple[float, list[tuple[int, ...]], int] | None = None
        for c in weakest[:tries] if len(used) > 1 else ():
            try:
                t, groups = _form(costs, pool, sorted(i for i in used if i != c), clusters,
                                  max_clusters)
            except PlanError:
                continue
            if best is None or t > best[0]:
                best = (t, groups, c)
        if best is None or (auto and best[0] < floor):
            if auto:
                break
            raise PlanError(f"spec.plan.spares: {want} spare(s) leave too few providers to hold "
                            f"the model in {clusters or 'the'} cluster(s); {len(aside)} can be "
                            f"set aside")
        throughput, ordered, _ = best
        aside.append(best[2])
    return throughput, ordered, aside


def _data_clusters(work: Workload, samples: int, clusters: int | None,
                   max_clusters: int | None) -> int:
    """The most clusters that each get a batch (times updateFrequency) of `samples` per epoch;
    a PlanError naming the field when not even one does, or a fixed count exceeds it."""
    per_cluster = work.batch_size * work.update_frequency
    fit = samples // per_cluster
    batches = (f"batchSize {work.batch_size}" if work.update_frequency == 1 else
               f"batchSize {work.batch_size} x updateFrequency {work.update_frequency}")
    if fit == 0:
        raise PlanError(f"spec.data.batchSize: {samples} training samples cannot fill one "
                        f"step of {batches} samples; lower batchSize")
    if clusters is not None and clusters > fit:
        raise PlanError(f"spec.plan.clusters: {clusters} clusters x {batches} need "
                        f"{clusters * per_cluster} training samples per step, but the training "
                        f"set has {samples}: at most {fit} cluster(s) get a batch; lower "
                        "spec.plan.clusters or spec.data.batchSize")
    return min(fit, max_clusters or fit)


def _cluster_range(costs: Costs, pool: Sequence[ProviderInfo], clusters: int | None,
                   max_clusters: int | None) -> tuple[int, int]:
    """The fewest and the most clusters to search: `clusters` when it is set, else from as few as
    the model's cuts allow to as many as the pool's RAM and `max_clusters` allow.

    Raises PlanError when the pool cannot hold the model or `clusters` exceeds the providers.
    """
    total_ram = sum(p.ram_gb for p in pool)
    if total_ram * GB < costs.total_memory:
        raise PlanError(
            f"spec.providers: total RAM {total_ram:.3g} GB is below the model's training memory "
            f"{costs.total_memory / GB:.3g} GB (parameters, gradients, optimizer state and "
            "activations); add providers or RAM")
    if clusters is not None and clusters > len(pool):
        raise PlanError(f"spec.plan.clusters: {clusters} clusters need at least {clusters} "
                        f"providers, got {len(pool)}")
    if clusters:
        return clusters, clusters
    n = len(pool)
    hi = min(n, max_clusters or n, max(1, int(total_ram * GB // costs.total_memory)))
    return min(hi, math.ceil(n / (len(costs.allowed) - 1))), hi


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
    costs = Costs(profile, work)
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


def _build(profile: Profile, costs: Costs, pool: Sequence[ProviderInfo],
           groups: Sequence[Sequence[int]], throughput: float, identity: dict[str, Any],
           spares: tuple[SparePlan, ...] = ()) -> Plan:
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
                samples_per_second=round(throughput, 3), kept_whole=profile.kept_whole,
                spares=spares)
    return replace(plan, fingerprint=fingerprint(plan, identity))


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

