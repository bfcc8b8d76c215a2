"""Growing a running job's plan (issue 20, grow): the providers added to it form new clusters
that take the stages of planned ones, so that nothing the running clusters hold changes. Plan
arithmetic only (the operator uses it too: nothing here builds or traces a model)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ravnest.errors import PlanError
from ravnest.plan.plans import GB, ClusterPlan, Plan, ProviderInfo


def _mirror(plan: Plan, providers: Sequence[tuple[int, ProviderInfo]]) -> ClusterPlan | None:
    """The first planned cluster whose stages, in order, fit the memory of `providers`' first
    ones (as many as it has stages), if any."""
    for c in plan.clusters[:plan.planned]:
        nodes = plan.cluster_nodes(c.id)
        if len(nodes) <= len(providers) and all(
                info.ram_gb * GB >= n.memory_bytes
                for n, (_, info) in zip(nodes, providers, strict=False)):
            return c
    return None


def grow(plan: Plan, added: Sequence[tuple[int, ProviderInfo]]) -> Plan:
    """The plan of a running job with the providers `added` (provider index, what it offers),
    in order, formed into new clusters that join it (issue 20, grow).

    The running clusters keep their stages, so that nothing they hold changes: each new cluster
    takes the stages of the first planned cluster whose memory its providers hold in order, and
    its nodes join that cluster's rings (appended: one member per cluster, in cluster order).
    Its nodes are named by provider, as the planner names them. The fingerprint stays the
    planned one's, and `planned_clusters` keeps the count the data is sharded over. Raises
    PlanError, naming the provider, when the added providers cannot all be placed so."""
    if plan.planned < 2:
        raise PlanError("a job planned with one cluster has no rings for a new cluster to "
                        "join: plan it with spec.plan.clusters of 2 or more to let it grow")
    taken = {n.provider for n in plan.nodes} | {s.provider for s in plan.spares}
    for idx, _ in added:
        if idx in taken:
            raise PlanError(f"spec.providers[{idx}] runs in the job already")
    nodes, clusters, rings = list(plan.nodes), list(plan.clusters), list(plan.rings)
    rest = list(added)
    while rest:
        mirror = _mirror(plan, rest)
        if mirror is None:
            sizes = sorted({len(c.nodes) for c in plan.clusters[:plan.planned]})
            raise PlanError(
                f"spec.providers[{rest[0][0]}]: the providers added from here on cannot form a "
                f"cluster of the running job: a new cluster takes the stages of a planned one "
                f"({'/'.join(map(str, sizes))} stage(s)), and its providers, in order, must hold "
                f"their memory")
        cid, names = len(clusters), []
        for n, (idx, info) in zip(plan.cluster_nodes(mirror.id), rest, strict=False):
            new = replace(n, name=f"node_{idx}", provider=idx, cluster=cid, ram_gb=info.ram_gb)
            nodes.append(new)
            names.append(new.name)
            rings = [replace(r, members=(*r.members, new.name)) if n.name in r.members else r
                     for r in rings]
        rest = rest[len(names):]
        clusters.append(ClusterPlan(cid, tuple(names), mirror.seconds_per_batch))
    return replace(plan, clusters=tuple(clusters), nodes=tuple(nodes), rings=tuple(rings),
                   planned_clusters=plan.planned)
