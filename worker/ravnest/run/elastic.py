"""The rules of elastic training that both supervisors follow, the local runner (`run.local`) and
the operator (`ravnest_operator.deciding`), as pure functions of the plan, the policy and what the
supervisor saw: whether a loss costs only its cluster, when a job ends without a cluster,
which hot spare takes over a lost provider's stage, which providers an edited spec removed, which
clusters drain when providers are removed from a running job, and the job's membership versions
that follow.

Each supervisor observes its own way (processes' exit codes; pods' phases) and acts its own way
(restarting processes; deleting and creating pods); what it decides is decided here, once.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from ravnest.errors import RavnestError
from ravnest.plan.plans import GB, Plan, SparePlan
from ravnest.spec import Provider, RunPolicy


def restart_alone(plan: Plan, policy: RunPolicy, lost: Collection[int], whole: Collection[int],
                  recoveries: int, spec_error: bool) -> bool:
    """Whether the loss of the clusters `lost` is absorbed by restarting that cluster alone
    (runPolicy.recovery: cluster): one cluster lost of several, another cluster still whole
    (`whole`: the clusters all of whose workers run), the lost one sharing parameters with the
    others (so that they hold its state), no spec error (which no restart cures), and fewer than
    recoveryLimit `recoveries` so far. False: the whole job restarts from its last checkpoint."""
    if policy.recovery != "cluster" or len(plan.clusters) < 2 or len(lost) != 1 or spec_error:
        return False
    (cluster,) = lost
    root = plan.cluster_nodes(cluster)[0].name
    shares = any(plan.node(m).cluster != cluster for r in plan.rings_of(root) for m in r.members)
    return shares and any(c != cluster for c in whole) and recoveries < policy.recovery_limit


def ended_without(policy: RunPolicy, plan: Plan, finished: Collection[int],
                  unable: Collection[int], drained: Collection[int] = ()) -> set[int]:
    """The clusters a job ends without (runPolicy.recovery: cluster): once at least one cluster
    has finished training (`finished`), the rest, if each of them is `unable` to finish (failed,
    lost, or restarted alone and not yet back: nobody is left to take the state from). The final
    round averaged the finished ones, whose model is the job's. Empty: nothing to end without.
    The clusters that `drained` are neither: they left the job before."""
    rest = {c.id for c in plan.clusters} - set(finished) - set(drained)
    if policy.recovery != "cluster" or not finished or not rest or not rest <= set(unable):
        return set()
    return rest


def joining(plan: Plan, recovered: Iterable[int], away: Collection[int]) -> set[int]:
    """The clusters that must join the others to train on: those restarted alone (`recovered`)
    and those added to the running job, less those `away` (finished, drained or left out)."""
    return ({*recovered} | {c.id for c in plan.clusters if plan.grown(c.id)}) - set(away)


def missed_final(joining: Collection[int], said: Iterable[Mapping[str, Any]]) -> set[int]:
    """Of the clusters `joining` (restarted alone, or added to the running job: each must join
    the others to train on), those that can no longer: no finished node's final round held one of
    their nodes, nor sent one the final state (`said`: the finished nodes' results, whose
    `final_clusters` says which clusters theirs did). Their pods may run, but whom they would
    take the state from is gone; waiting for them would only wait for their peer timeout. Empty
    where no finished node says (none shares a ring)."""
    held = [c for s in said if isinstance(c := s.get("final_clusters"), list)]
    if not held:
        return set()
    return set(joining) - {c for cs in held for c in cs if isinstance(c, int)}


def spare_for(plan: Plan, node: str, free: Iterable[SparePlan]) -> SparePlan | None:
    """The hot spare that takes over the stage of `node`, whose provider was lost: among the
    `free` spares, the smallest whose RAM holds the stage's training memory (ties: the lowest
    provider); None when none does."""
    need = plan.node(node).memory_bytes
    fits = [s for s in free if s.ram_gb * GB >= need]
    return min(fits, key=lambda s: (s.ram_gb, s.provider), default=None)


def choose_spares(plan: Plan, lost: Iterable[str], free: Iterable[SparePlan]
                  ) -> dict[str, SparePlan]:
    """The free hot spare that takes over the stage of each node in `lost` whose stage one
    holds (`spare_for`), a spare for one node only, in the order of `lost`; what both
    supervisors do when they restart lost nodes, alone with their cluster or with the whole job:
    the node's worker runs as the spare's provider from then on, and the lost provider becomes a
    spare."""
    left = list(free)
    chosen: dict[str, SparePlan] = {}
    for node in lost:
        spare = spare_for(plan, node, left)
        if spare is not None:
            left.remove(spare)
            chosen[node] = spare
    return chosen


def removed_providers(planned: Sequence[Provider], now: Sequence[Provider]) -> list[int] | None:
    """The providers (indices into `planned`, the job's providers as planned, replicas expanded)
    that an edited spec no longer has (`now`, expanded too), when removing them is the edit: `now`
    is `planned` with some providers left out, in the same order. Of identical providers (an
    entry's replicas) the last ones are the ones removed, as a StatefulSet scaled down loses its
    highest ordinals. None: `now` is no such subsequence (a provider added or changed)."""
    removed, i = [], 0
    for p in now:
        while i < len(planned) and planned[i] != p:
            removed.append(i)
            i += 1
        if i == len(planned):
            return None
        i += 1
    return [*removed, *range(i, len(planned))]


def added_providers(planned: Sequence[Provider], now: Sequence[Provider]) -> list[int] | None:
    """The providers (indices into `now`, replicas expanded) that an edited spec adds to the job's
    providers as planned, when adding them is the edit: `now` is `planned` with more after it.
    None otherwise."""
    if len(now) <= len(planned) or list(now[:len(planned)]) != list(planned):
        return None
    return list(range(len(planned), len(now)))


def drain_for(plan: Plan, providers: Collection[int], runs_on: Mapping[str, int],
              drained: Collection[int]) -> set[int]:
    """The clusters to drain so that `providers` leave a running job: the cluster of each one's
    stage (`runs_on`: node -> the provider that runs it now, a spare's after a takeover). Raises
    RavnestError, naming the provider, for one that runs no stage (a spare, or not the job's),
    and when no cluster would be left to train."""
    problems, clusters = [], set()
    for p in providers:
        nodes = [n for n, q in runs_on.items() if q == p]
        if not nodes:
            known = sorted(set(runs_on.values()))
            problems.append(f"provider {p} runs no stage of this job (those that do: "
                            f"{', '.join(map(str, known))}); a spare or another job's provider "
                            f"has nothing to drain")
        clusters |= {plan.node(n).cluster for n in nodes}
    if problems:
        raise RavnestError("; ".join(problems))
    left = {c.id for c in plan.clusters} - set(drained) - clusters
    if not left:
        raise RavnestError(f"draining cluster(s) {', '.join(map(str, sorted(clusters)))} would "
                           f"leave no cluster to train: stop the job instead")
    return clusters - set(drained)


def drained_by(plan: Plan, cluster: int, providers: Iterable[int],
               runs_on: Mapping[str, int]) -> list[int]:
    """Those of `providers` that run a stage of `cluster` (`runs_on`: node -> the provider that
    runs it now), sorted: the providers its drain order names."""
    mine = {runs_on[n.name] for n in plan.cluster_nodes(cluster)}
    return sorted(p for p in providers if p in mine)


def gone_nodes(plan: Plan, drained: Iterable[int]) -> list[str]:
    """The nodes of the clusters that `drained`, by cluster: those a worker started after the
    drain goes without (`run.metadata.GONE_ENV`)."""
    return [n.name for c in sorted(drained) for n in plan.cluster_nodes(c)]


def membership(plan: Plan, drained: Iterable[Mapping[str, Any]],
               joined: Iterable[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """The job's membership, versioned: the plan's fingerprint and, for each version, the
    clusters that take part in the rounds from `fromRound` on. Version 1 is the plan's (as
    planned); each cluster that drained (`drained`: its cluster and leave round) or that was added
    and joined (`joined`: its cluster and join round) starts a version from the round after."""
    clusters = [c.id for c in plan.clusters[:plan.planned]]
    versions = [{"version": 1, "fromRound": 1, "clusters": list(clusters)}]
    events = [(int(d["round"]), int(d["cluster"]), False) for d in drained] + [
        (int(j["round"]), int(j["cluster"]), True) for j in joined
        if isinstance(j.get("round"), int)]
    for round_, cluster, added in sorted(events):
        clusters = sorted({*clusters, cluster}) if added else [c for c in clusters
                                                              if c != cluster]
        start = round_ + 1
        if versions[-1]["fromRound"] == start:  # (two clusters that left after one round)
            versions[-1]["clusters"] = list(clusters)
        else:
            versions.append({"version": len(versions) + 1, "fromRound": start,
                             "clusters": list(clusters)})
    return {"plan": plan.fingerprint, "versions": versions}


def _ids(clusters: Iterable[int]) -> str:
    return ", ".join(map(str, sorted(clusters)))


def restarted_alone(failure: str, cluster: int, recovery: int, limit: int, whole: Iterable[int],
                    taken: str = "") -> str:
    """What both supervisors say when they restart cluster `cluster` alone after `failure` (its
    `recovery`-th recovery of `limit`; `taken`: which spare took over a lost stage)."""
    return (f"{failure}; cluster {cluster} restarted alone (recovery {recovery}/{limit}){taken}: "
            f"it takes its state from cluster(s) {_ids(whole)} and rejoins at a round boundary, "
            f"while they train on")


def taken_over(spares: Mapping[str, str]) -> str:
    """What both supervisors add to the message of a restart (a cluster's alone,
    `restarted_alone`, or the whole job's) when hot spares take lost stages over (`spares`: node
    -> the spare that takes its stage over); "" when none does."""
    return "".join(f"; spare {spare} took over the stage of {node}"
                   for node, spare in spares.items())


def drained_out(cluster: int, round_: Any, updates: Any) -> str:
    """What both supervisors say when cluster `cluster`'s root says it drained after ring round
    `round_`, at update `updates`."""
    return (f"cluster {cluster} drained after round {round_} (update {updates}): the job goes on "
            f"without it")


def not_drained(cluster: int) -> str:
    """What both supervisors say of a cluster told to drain that finished training with the
    others before it could (told too near the end)."""
    return (f"cluster {cluster} finished training with the others before it could drain: it "
            f"stays in the job's model")


def growing(providers: Iterable[int], clusters: Iterable[int], how: str) -> str:
    """What both supervisors say when `providers`, added `how` (to spec.providers, by a grow
    order), form `clusters`, which join the running job."""
    return (f"provider(s) {_ids(providers)} added {how} form cluster(s) {_ids(clusters)}: they "
            f"join the running job at a round boundary with its latest state, while the others "
            f"train on")


def abandoned(clusters: Iterable[int], done: Iterable[int], why: str) -> str:
    """What both supervisors say when a job ends without `clusters` (`ended_without`), which
    could not rejoin (`why`) before the clusters `done` finished."""
    return (f"cluster(s) {_ids(clusters)} could not rejoin before the others finished ({why}): "
            f"the job ends without them, with the model of cluster(s) {_ids(done)}, which the "
            f"final round averaged")
