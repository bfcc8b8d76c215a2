"""What a job's supervisor does when workers are lost, decided once for both supervisors: the
local runner (`ravnest.run.local`, which sees its worker processes) and the operator
(`ravnest_operator.deciding`, which sees the job's pods).

Each supervisor turns what it sees into the same typed observations (`Seen`: a node's phase, how
its process ended and when, parsed once by `ravnest.termination`), keeps the same memory between
decisions (`Memory`: restarts, recoveries, how the last failures read), and on each pass over a
running job asks `decide_running`, a pure function, what to do, in one order for both: the
clusters the job ends without (`ends_without`), then every node failed or lost, the first to end
first, and what to do about them (`after_loss`: restart the lost cluster alone, restart the whole
job from its last checkpoint, wait for the clusters finishing, or fail the job), else whether the
job is done, which clusters rejoining are back, and whether it ran past its deadline. It then
carries the answer out its own way (processes and files; pods, status and Events) and says the
message the answer holds.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from ravnest.plan.plans import Plan
from ravnest.run import elastic, jobstatus
from ravnest.run.jobstatus import set_condition
from ravnest.spec import RunPolicy
from ravnest.termination import NOT_ENDED, Ending


class NodePhase(StrEnum):
    """Where a node's process stands (a pod's phase; Missing: it has none)."""

    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    MISSING = "Missing"

    @classmethod
    def of(cls, phase: str | None) -> NodePhase:
        """A pod's phase as a node's (none yet, or Unknown, whose kubelet is not heard from:
        Pending)."""
        try:
            return cls(phase or "Pending")
        except ValueError:
            return cls.PENDING


@dataclass(frozen=True)
class Seen:
    """A worker node as its supervisor saw it: its cluster, its phase, how its process ended,
    whether it is being deleted (a pod: lost like a failed one)."""

    node: str
    cluster: int
    phase: NodePhase
    ending: Ending = NOT_ENDED
    deleting: bool = False
    disrupted: str = ""
    """Why it was disrupted, when it was (a pod evicted, preempted or deleted by its node's
    taints: its DisruptionTarget condition's reason, or Evicted); empty otherwise."""

    @property
    def running(self) -> bool:
        """It runs, and is not going away."""
        return self.phase == NodePhase.RUNNING and not self.deleting


def seen_in_process(node: str, cluster: int, exit_code: int | None, ending: Ending) -> Seen:
    """A node as its local process shows it: running (`exit_code` None), succeeded (0) or
    failed, with how it ended (`termination.of_local`)."""
    phase = (NodePhase.RUNNING if exit_code is None else
             NodePhase.SUCCEEDED if exit_code == 0 else NodePhase.FAILED)
    return Seen(node, cluster, phase, ending)


_STAMP = re.compile(r"^\[?\d{4}-\d\d-\d\d[ T][\d:,.]+\]?\s*")


def failed_as(ending: Ending) -> str | None:
    """What a failure is known by when a supervisor decides whether a restart failed the same way
    as before: its exit code and what the process said last (its termination message's last line,
    or its log's, without a timestamp). None for a process killed by a signal (an outside event: a
    kill, the OOM killer, a lost machine) or one that said nothing: such a failure is never taken
    for a repeated one."""
    code = ending.exit_code
    said = _STAMP.sub("", ending.said)
    if code is None or code <= 0 or code > 128 or not said:
        return None
    return f"exit code {code}: {said}"


@dataclass(frozen=True)
class Memory:
    """What a supervisor keeps between decisions: whole restarts and clusters restarted alone so
    far, how the failure that led to the last whole restart read (`failed_as`), and each
    cluster's last failure that it was restarted alone for."""

    restarts: int = 0
    recoveries: int = 0
    failed_as: str | None = None
    cluster_failed_as: Mapping[int, str] = field(default_factory=dict)
    disrupted_restarts: int = 0
    """Of `restarts`, those for a disruption (`AfterLoss.disruption`): not counted against
    backoffLimit."""
    disrupted_recoveries: int = 0
    """Of `recoveries`, those for a disruption: not counted against recoveryLimit."""

    def disruptions(self) -> dict[str, int] | None:
        """status.disruptions (`jobstatus.Disruptions`); None with none."""
        if not (self.disrupted_restarts or self.disrupted_recoveries):
            return None
        return {"restarts": self.disrupted_restarts, "recoveries": self.disrupted_recoveries}

    def last_failures(self) -> dict[str, Any] | None:
        """status.lastFailures (`jobstatus.LastFailures`): the job's, and each cluster's as a
        list by cluster id (a merge patch replaces it whole); None with none known."""
        known = self.cluster_failed_as
        if self.failed_as is None and not known:
            return None
        return {"job": self.failed_as,
                "clusters": [known.get(c) for c in range(max(known, default=-1) + 1)]}

    @classmethod
    def of_status(cls, status: Mapping[str, Any]) -> Memory:
        """The memory a job's status keeps: restarts, recoveries and status.lastFailures (what
        is not of its type, ignored)."""
        failures = status.get("lastFailures")
        failures = failures if isinstance(failures, dict) else {}
        clusters, job = failures.get("clusters"), failures.get("job")
        disrupted = status.get("disruptions")
        disrupted = disrupted if isinstance(disrupted, dict) else {}
        restarts, recoveries = _count(status.get("restarts")), _count(status.get("recoveries"))
        return cls(restarts=restarts, recoveries=recoveries,
                   failed_as=job if isinstance(job, str) else None,
                   cluster_failed_as={c: f for c, f in enumerate(
                       clusters if isinstance(clusters, list) else []) if isinstance(f, str)},
                   disrupted_restarts=min(_count(disrupted.get("restarts")), restarts),
                   disrupted_recoveries=min(_count(disrupted.get("recoveries")), recoveries))

    @property
    def counted_restarts(self) -> int:
        """The restarts backoffLimit counts."""
        return self.restarts - self.disrupted_restarts

    @property
    def counted_recoveries(self) -> int:
        """The recoveries recoveryLimit counts."""
        return self.recoveries - self.disrupted_recoveries


def _count(value: Any) -> int:
    """A count the status keeps (anything but a non-negative integer: 0)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


class Act(StrEnum):
    RESTART_CLUSTER = "RestartCluster"
    """Restart the lost cluster alone: it takes its state from the others and rejoins them."""
    RESTART_JOB = "RestartJob"
    """Restart every worker from the job's last checkpoint."""
    FAIL = "Fail"
    """The job fails."""
    WAIT = "Wait"
    """Nothing yet: another cluster is finishing, and the job then ends without the lost one
    (`elastic.ended_without`), or a loss there is decided anew."""


@dataclass(frozen=True)
class AfterLoss:
    """What to do about a loss (`act`), why (`said()`, which the supervisor says), and what to
    remember once it is done (`memory`)."""

    act: Act
    memory: Memory
    failure: str
    """How the loss came about, in the supervisor's words."""
    cluster: int | None = None
    """The cluster restarted alone."""
    whole: tuple[int, ...] = ()
    """The clusters it takes its state from (waiting: the clusters finishing)."""
    limit: int = 0
    """recoveryLimit (a cluster restarted alone) or backoffLimit."""
    again: bool = False
    """It failed the same way as before its last restart."""
    disruption: bool = False
    """Every node lost was disrupted (`Seen.disrupted`: evicted, preempted): the restart is not
    counted against backoffLimit or recoveryLimit, as a Kubernetes Job's podFailurePolicy can
    ignore a DisruptionTarget."""

    @property
    def reason(self) -> str:
        """The reason of the condition the supervisor sets."""
        if self.act == Act.WAIT:
            return "OthersFinishing"
        if self.act != Act.FAIL:
            return DISRUPTED if self.disruption else "WorkerFailed"
        return "RepeatedFailure" if self.again else "BackoffLimitExceeded"

    def said(self, taken: str = "", resumes: str = "resumes from the last checkpoint") -> str:
        """What the supervisor says (`taken`: which spare took a lost stage over, if one did;
        `resumes`: what a whole restart resumes from)."""
        if self.act == Act.WAIT:
            return (f"{self.failure}; cluster(s) {', '.join(map(str, self.whole))} finishing: the "
                    f"job ends without the lost cluster once they have finished")
        if self.disruption and self.act == Act.RESTART_CLUSTER:
            assert self.cluster is not None
            return (f"{self.failure}; a disruption, not counted against recoveryLimit: "
                    f"cluster {self.cluster} restarts alone and rejoins cluster(s) "
                    f"{', '.join(map(str, self.whole))}{taken}")
        if self.disruption and self.act == Act.RESTART_JOB:
            return (f"{self.failure}; a disruption, not counted against backoffLimit: the job "
                    f"restarts and {resumes}{taken}")
        if self.act == Act.RESTART_CLUSTER:
            assert self.cluster is not None
            return elastic.restarted_alone(self.failure, self.cluster,
                                           self.memory.counted_recoveries, self.limit,
                                           self.whole, taken)
        if self.act == Act.RESTART_JOB:
            return (f"{self.failure}; restart {self.memory.counted_restarts}/{self.limit} "
                    f"{resumes}{taken}")
        used = (f" after {self.memory.counted_restarts} restart(s), backoffLimit {self.limit}"
                if self.limit else "")
        why = ("; it failed the same way as before its last restart, so it is not restarted "
               "again" if self.again else "")
        return f"{self.failure}{used}{why}"


def after_loss(plan: Plan, policy: RunPolicy, nodes: Mapping[str, Seen], down: Sequence[Seen],
               failure: str, memory: Memory, *,
               rejoining: Collection[int] = (), drained: Collection[int] = ()) -> AfterLoss:
    """What a supervisor does when the nodes `down` failed or were lost (`failure` says how, in
    the supervisor's words; `nodes`: the plan's nodes as seen, those of drained clusters left
    out or not; `rejoining`: clusters restarted alone and not running again yet; `drained`:
    clusters that left the job).

    1. Wait, with runPolicy.recovery: cluster, while another cluster is finishing (some of its
       workers succeeded, the others still run): the job will end without the lost cluster once
       they are done, as the others' final round averaged them, instead of restarting everyone
       a moment before the end.
    2. Restart their cluster alone (runPolicy.recovery: cluster) when `elastic.restart_alone`
       allows it (one cluster lost, another whole, no spec error, recoveryLimit not reached) and
       the cluster did not fail the same way the last time it was restarted alone.
    3. Else restart the whole job from its last checkpoint, until
       backoffLimit restarts are used up, unless it failed the same way as before its last whole
       restart: restarting cannot cure that.
    4. Else fail the job.

    A disruption (every node in `down` was evicted or preempted, `Seen.disrupted`) is restarted
    as 2 or 3 say, neither counted against recoveryLimit or backoffLimit nor taken for a failure
    of its own; it never fails the job.
    """
    lost = {s.cluster for s in down}
    whole = tuple(sorted(c.id for c in plan.clusters if c.id not in {*lost, *rejoining, *drained}
                         and all(n in nodes and nodes[n].running for n in c.nodes)))
    finishing = tuple(c.id for c in plan.clusters if c.id not in {*lost, *drained}
                      and _finishing([nodes.get(n) for n in c.nodes]))
    disruption = bool(down) and all(s.disrupted for s in down)
    if policy.recovery == "cluster" and finishing:
        return AfterLoss(Act.WAIT, memory, failure, whole=finishing, disruption=disruption)
    if disruption:
        return _restart_disrupted(plan, policy, lost, whole, failure, memory)
    known = next((f for s in down if (f := failed_as(s.ending))), None)
    spec_error = any(s.ending.spec_error for s in down)
    if elastic.restart_alone(plan, policy, lost, whole, memory.counted_recoveries, spec_error):
        (cluster,) = lost
        if known is None or memory.cluster_failed_as.get(cluster) != known:
            remembered = {c: f for c, f in memory.cluster_failed_as.items() if c != cluster}
            if known is not None:
                remembered[cluster] = known
            after = replace(memory, recoveries=memory.recoveries + 1,
                            cluster_failed_as=remembered)
            return AfterLoss(Act.RESTART_CLUSTER, after, failure, cluster=cluster, whole=whole,
                             limit=policy.recovery_limit)
    limit = policy.backoff_limit
    again = known is not None and known == memory.failed_as
    if memory.counted_restarts < limit and not again:
        after = replace(memory, restarts=memory.restarts + 1, failed_as=known)
        return AfterLoss(Act.RESTART_JOB, after, failure, limit=limit)
    return AfterLoss(Act.FAIL, memory, failure, limit=limit, again=again)


DISRUPTED = "Disrupted"
"""The reason a supervisor restarts with after a disruption (`AfterLoss.disruption`)."""


def _restart_disrupted(plan: Plan, policy: RunPolicy, lost: set[int], whole: tuple[int, ...],
                       failure: str, memory: Memory) -> AfterLoss:
    """`after_loss`'s restart after a disruption: the lost cluster restarted alone where elastic
    training allows it (as if no recovery had been used), else the whole job, neither counted."""
    if elastic.restart_alone(plan, policy, lost, whole, 0, False):
        (cluster,) = lost
        after = replace(memory, recoveries=memory.recoveries + 1,
                        disrupted_recoveries=memory.disrupted_recoveries + 1)
        return AfterLoss(Act.RESTART_CLUSTER, after, failure, cluster=cluster, whole=whole,
                         limit=policy.recovery_limit, disruption=True)
    after = replace(memory, restarts=memory.restarts + 1,
                    disrupted_restarts=memory.disrupted_restarts + 1)
    return AfterLoss(Act.RESTART_JOB, after, failure, limit=policy.backoff_limit,
                     disruption=True)


def _finishing(nodes: Sequence[Seen | None]) -> bool:
    """A cluster finishing: some of its workers succeeded, the others still run."""
    return (all(s is not None and (s.phase == NodePhase.SUCCEEDED or s.running) for s in nodes)
            and any(s is not None and s.phase == NodePhase.SUCCEEDED for s in nodes))


@dataclass(frozen=True)
class EndsWithout:
    """The clusters a job ends without (`clusters`: those it already did and the `new` ones),
    once the clusters `done` have finished, and why the new ones could not rejoin them."""

    clusters: frozenset[int]
    new: frozenset[int]
    done: frozenset[int]
    why: str

    def said(self) -> str:
        """What the supervisor says."""
        return elastic.abandoned(self.new, self.done, self.why)


FAILED_AFTER = "failed or lost"
NOT_BACK = "restarted, and not running again yet"
TOO_LATE = "restarted, and running again only after the others' final round"


def ends_without(plan: Plan, policy: RunPolicy, nodes: Mapping[str, Seen], *,
                 recovered: Iterable[int], rejoining: Collection[int] = (),
                 drained: Collection[int] = (), abandoned: Collection[int] = ()
                 ) -> EndsWithout | None:
    """Whether a job ends without some of its clusters now (runPolicy.recovery: cluster): once
    every other cluster has finished (all its workers succeeded), those that cannot finish with
    them: failed or lost, restarted alone and not running again yet (`rejoining`), or running
    again (restarted alone, `recovered`, or added to the job) but too late, no finished node's
    final round having held them or sent them its state (their termination messages say,
    `elastic.missed_final`): they would wait for nodes that are gone until their peer timeout.
    The final round averaged the finished ones, whose model is the job's. None: nothing new to
    end without (`abandoned`: the clusters it already ends without; `drained`: those that left)."""
    away = {*drained, *abandoned}
    done = {c.id for c in plan.clusters if c.id not in away
            and all(n in nodes and nodes[n].phase == NodePhase.SUCCEEDED for n in c.nodes)}
    if not done:
        return None
    joining = elastic.joining(plan, recovered, done | away)
    late = elastic.missed_final(joining, [nodes[n].ending.figures for c in plan.clusters
                                          if c.id in done for n in c.nodes]) if joining else set()
    failed = {s.cluster for s in nodes.values()
              if s.deleting or s.phase in (NodePhase.FAILED, NodePhase.MISSING)}
    rest = elastic.ended_without(policy, plan, done, {*abandoned, *rejoining, *late, *failed},
                                 drained)
    new = rest - set(abandoned)
    if not new:
        return None
    said = {NOT_BACK if c in rejoining else TOO_LATE if c in late else FAILED_AFTER for c in new}
    why = "; ".join(r for r in (FAILED_AFTER, NOT_BACK, TOO_LATE) if r in said)
    return EndsWithout(frozenset(rest | set(abandoned)), frozenset(new), frozenset(done), why)


DEADLINE_EXCEEDED = "DeadlineExceeded"


def past_deadline(deadline: int | None, seconds_running: float) -> str | None:
    """Why a job that has run `seconds_running` seconds fails now: past its
    runPolicy.activeDeadlineSeconds, `deadline` (reason `DEADLINE_EXCEEDED`); None while it is
    not, or without one."""
    if deadline and seconds_running > deadline:
        return f"job ran longer than activeDeadlineSeconds={deadline}"
    return None


def recovered(condition: Mapping[str, str]) -> str:
    """What a supervisor says when the job runs again after what `condition` (Restarting, True)
    said (Recovering: `rejoined`)."""
    return f"running again after: {condition['message']}"


def back_again(rejoining: Collection[int], nodes: Mapping[str, Seen]) -> set[int]:
    """The clusters of `rejoining` (restarted alone, or added to the running job, and not
    training yet) whose nodes all run again, or finished: from now on they train with the
    others (`clusters_active`), and once none is left rejoining, Recovering turns False
    (`REJOINED`, `rejoined`)."""
    return {c for c in rejoining if all(s.phase in (NodePhase.RUNNING, NodePhase.SUCCEEDED)
                                        for s in nodes.values() if s.cluster == c)}


REJOINED = "Rejoined"
"""The reason Recovering turns False with: every cluster restarted alone runs again."""


def rejoined(back: Collection[int], condition: Mapping[str, str]) -> str:
    """What a supervisor says when the clusters `back` run again after what `condition`
    (Recovering, True) said, and none is left rejoining."""
    return (f"cluster(s) {', '.join(map(str, sorted(back)))} running again after: "
            f"{condition['message']}")


@dataclass(frozen=True)
class Running:
    """What a supervisor does in one pass over a running job (`decide_running`)."""

    ends: EndsWithout | None = None
    """The job ends without some clusters from now on: stop the workers of the new ones, and
    say it (`EndsWithout.said`)."""
    away: frozenset[int] = frozenset()
    """The clusters the job ends without (before this pass, or from it): the rest of the pass,
    and the job, go on without them."""
    down: tuple[Seen, ...] = ()
    """The nodes that failed or were lost, the first to end first."""
    loss: AfterLoss | None = None
    """What to do about `down` (`after_loss`)."""
    done: bool = False
    """Every worker succeeded: finish the job."""
    back: frozenset[int] = frozenset()
    """The clusters rejoining that train with the others again (`back_again`)."""
    up: bool = False
    """Every worker of the job (those of the clusters away left out) runs, or finished: the job
    runs (`all_running`)."""
    past: str | None = None
    """The job ran past its deadline: it fails (reason `DEADLINE_EXCEEDED`), saying this."""


def decide_running(plan: Plan, policy: RunPolicy, nodes: Mapping[str, Seen], memory: Memory,
                   describe: Callable[[Sequence[Seen]], str], *,
                   rejoining: Collection[int] = (), drained: Collection[int] = (),
                   abandoned: Collection[int] = (), recovered: Iterable[int] = (),
                   seconds_running: float = 0.0, vanished_lost: bool = True) -> Running:
    """One pass of a supervisor over a running job, for both supervisors, in this order:

    1. the clusters it ends without from now on (`ends_without`); the rest of the pass leaves
       them out, as it leaves out the drained ones;
    2. the nodes failed or lost (failed; or, with `vanished_lost`, being deleted or gone
       although their cluster is not rejoining: the operator's pods once the job runs, not
       while they are being made; a local worker's process never vanishes, it ends), the first
       to end first: what to do about them
       (`after_loss`; `describe` puts their failure in the supervisor's words);
    3. else, every worker succeeded: the job is done;
    4. else, the clusters rejoining that are back (`back_again`), and whether the job ran past
       its deadline (`past_deadline`, after `seconds_running` seconds).

    `nodes`: the plan's nodes as seen; `rejoining`: clusters restarted alone or added and not
    running again yet; `drained`: clusters that left the job; `abandoned`: those it ended
    without before this pass; `recovered`: clusters restarted alone in this attempt."""
    nodes = {n: s for n, s in nodes.items() if s.cluster not in drained}
    ends = ends_without(plan, policy, nodes, recovered=recovered, rejoining=rejoining,
                        drained=drained, abandoned=abandoned)
    away = ends.clusters if ends is not None else frozenset(abandoned)
    nodes = {n: s for n, s in nodes.items() if s.cluster not in away}
    rejoining = set(rejoining) - away
    failed = sorted((s for s in nodes.values() if s.phase == NodePhase.FAILED),
                    key=lambda s: (s.ending.finished_at is None, s.ending.finished_at or ""))
    lost = [s for s in nodes.values() if vanished_lost and s.phase != NodePhase.FAILED and (
        s.deleting or (s.phase == NodePhase.MISSING and s.cluster not in rejoining))]
    down = (*failed, *lost)
    if down:
        loss = after_loss(plan, policy, nodes, down, describe(down), memory,
                          rejoining=rejoining, drained=drained)
        return Running(ends, away, down, loss)
    if nodes and all(s.phase == NodePhase.SUCCEEDED for s in nodes.values()):
        return Running(ends, away, done=True)
    up = bool(nodes) and all(s.phase in (NodePhase.RUNNING, NodePhase.SUCCEEDED)
                             for s in nodes.values())
    return Running(ends, away, back=frozenset(back_again(rejoining, nodes)), up=up,
                   past=past_deadline(policy.active_deadline_seconds, seconds_running))


def clusters_active(plan: Plan, away: Collection[int]) -> str:
    """status.clusters: the clusters training / those of the plan (`away`: those rejoining,
    drained, or that the job ends without)."""
    return f"{len(plan.clusters) - len(set(away))}/{len(plan.clusters)}"


# What a decision does to the job's conditions, the same for both supervisors (each then writes
# them its own way: the job's status; status.json). `at`: the time of the pass (RFC 3339).
Conditions = list[dict[str, Any]]


def on_loss(conditions: Conditions, after: AfterLoss, said: str, at: str) -> Conditions:
    """The conditions once a loss is acted on as `after` says (`said`: its message,
    `AfterLoss.said`): Recovering (a cluster restarted alone, or waiting for the clusters
    finishing), Restarting (a whole restart), or the job failed (`failed`)."""
    if after.act in (Act.RESTART_CLUSTER, Act.WAIT):
        return set_condition(conditions, "Recovering", True, after.reason, said, at)
    if after.act == Act.RESTART_JOB:
        return set_condition(conditions, "Restarting", True, after.reason, said, at)
    return failed(conditions, after.reason, said, at)


def failed(conditions: Conditions, reason: str, message: str, at: str) -> Conditions:
    """The conditions of a job that failed (`reason`: why, as a condition's reason): Failed, and
    Running no more."""
    conditions = set_condition(conditions, "Failed", True, reason, message, at)
    return set_condition(conditions, "Running", False, reason, "", at)


ABANDONED = "Abandoned"
"""The reason Recovering turns False with when the job ends without the clusters it was about."""


def on_ends_without(conditions: Conditions, ends: EndsWithout, at: str) -> Conditions:
    """The conditions once the job ends without the clusters `ends` names: Recovering, False."""
    return set_condition(conditions, "Recovering", False, ABANDONED, ends.said(), at)


RECOVERED = "Recovered"
"""The reason Restarting turns False with: every worker runs again after a whole restart."""


def all_running(conditions: Conditions, reason: str, message: str, at: str) -> Conditions:
    """The conditions once every worker runs (`Running.up`; `reason` and `message`: the Running
    condition's, in the supervisor's words): Running, and Restarting False after a whole
    restart, keeping what it recovered from (`recovered`)."""
    conditions = set_condition(conditions, "Running", True, reason, message, at)
    restarting = jobstatus.condition(conditions, "Restarting")
    if restarting is not None and restarting.get("status") == "True":
        conditions = set_condition(conditions, "Restarting", False, RECOVERED,
                                   recovered(restarting), at)
    return conditions


def on_back(conditions: Conditions, back: Collection[int], left: Collection[int],
            at: str) -> Conditions:
    """The conditions once the clusters `back` train with the others again (`left`: those still
    rejoining): with none left, Recovering turns False (`REJOINED`, `rejoined`)."""
    recovering = jobstatus.condition(conditions, "Recovering")
    if not back or left or recovering is None or recovering.get("status") != "True":
        return conditions
    return set_condition(conditions, "Recovering", False, REJOINED, rejoined(back, recovering),
                         at)
