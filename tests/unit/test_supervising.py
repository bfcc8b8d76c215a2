"""What a supervisor does about a loss (ravnest.run.supervising.after_loss), decided once for both
supervisors: each scenario below is observed the operator's way (pods, as the API returns them,
through `statuses.observe`) and the local runner's way (processes' exit codes and termination
files, through `local.ending_of`), and both must come to the same decision."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from ravnest import parse_job, plan_job, termination
from ravnest.run import elastic, local, supervising
from ravnest.run.supervising import (
    FAILED_AFTER,
    NOT_BACK,
    RECOVERED,
    REJOINED,
    TOO_LATE,
    Act,
    AfterLoss,
    Memory,
    NodePhase,
    after_loss,
    all_running,
    back_again,
    clusters_active,
    decide_running,
    ends_without,
    failed_as,
    on_back,
    on_ends_without,
    on_loss,
    past_deadline,
    rejoined,
    seen_in_process,
)
from ravnest.spec import RunPolicy
from ravnest_operator import resources, statuses

ROOT = Path(__file__).resolve().parents[2]
BOOM = "ValueError: boom at step 5"
"""What a worker that fails the same way each time says."""


@pytest.fixture(scope="module")
def plan():
    job = parse_job(yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text()))
    planned, _, _ = plan_job(job)
    # cluster 0: node_0 (root) and node_5; cluster 1: node_1 .. node_4 (the tests rely on it)
    assert [sorted(c.nodes) for c in planned.clusters] == [
        ["node_0", "node_5"], ["node_1", "node_2", "node_3", "node_4"]]
    return planned


# A node's state, as the scenarios name it: running, succeeded, failed with (code, what it said),
# or killed (by a signal: an outside event, never taken for a repeated failure).
RUNNING, SUCCEEDED, KILLED = "running", "succeeded", "killed"


def failed(code: int = 1, said: str = BOOM) -> tuple[int, str]:
    return code, said


def finished(final: list[int] | None = None) -> tuple[int, str]:
    """Succeeded, saying which clusters its final round held (`final_clusters`)."""
    return 0, json.dumps({} if final is None else {"final_clusters": final})


def _pod(node: str, state: Any, ended: float | None = None) -> dict[str, Any]:
    """The pod of `node` in `state`, as the API returns it (its container's termination; `ended`:
    when, in seconds after 07:00)."""
    pod: dict[str, Any] = {"metadata": {"name": resources.pod_name("digits", node)},
                           "spec": {"containers": [{"name": "worker"}]}, "status": {}}
    if state == RUNNING:
        pod["status"] = {"phase": "Running"}
        return pod
    code, message = (0, "{}") if state == SUCCEEDED else (137, "") if state == KILLED else state
    reason = "Completed" if code == 0 else "Error"
    terminated = {"exitCode": code, "reason": reason, "message": message}
    if ended is not None:
        terminated["finishedAt"] = f"2026-11-28T07:{int(ended) // 60:02d}:{int(ended) % 60:02d}Z"
    pod["status"] = {"phase": "Succeeded" if code == 0 else "Failed", "containerStatuses": [
        {"name": "worker", "state": {"terminated": terminated}}]}
    return pod


def by_operator(plan, states: dict[str, Any], ended: dict[str, float] | None = None
                ) -> dict[str, Any]:
    obs = statuses.observe("digits", plan, [_pod(n, states.get(n, RUNNING), (ended or {}).get(n))
                                            for n in plan.names()])
    return {n: s.seen(n) for n, s in obs.nodes.items()}


def by_local_runner(plan, states: dict[str, Any], tmp: Path,
                    ended: dict[str, float] | None = None) -> dict[str, Any]:
    seen = {}
    for node in plan.names():
        state = states.get(node, RUNNING)
        log = tmp / f"{node}.log"
        env = termination.local_env({}, log)  # (where the worker's message goes)
        log.write_text("2026-11-28 07:00:00,000 INFO training\n")
        code: int | None
        if state == RUNNING:
            code = None
        elif state == SUCCEEDED:
            code = 0
            termination.write("{}", env)
        elif state == KILLED:
            code = -9  # (no message: killed)
        else:
            code, said = state
            termination.write(said, env)
            code = code or 0
        if node in (ended or {}):  # (its log's last write: when it ended)
            at = dt.datetime(2026, 11, 28, 7, tzinfo=dt.UTC).timestamp() + (ended or {})[node]
            os.utime(log, (at, at))
        seen[node] = seen_in_process(node, plan.node(node).cluster, code,
                                     local.ending_of(log, code, finished=True))
    return seen


# (scenario, node states, runPolicy, memory, rejoining) -> (act, cluster restarted alone, reason)
SCENARIOS: list[tuple[str, dict[str, Any], dict[str, Any], Memory, set[int], Any]] = [
    ("one cluster's worker killed, the other trains: that cluster alone",
     {"node_2": KILLED}, {}, Memory(), set(), (Act.RESTART_CLUSTER, 1, "WorkerFailed")),
    ("recovery job: every worker restarts", {"node_2": KILLED}, {"recovery": "job"}, Memory(),
     set(), (Act.RESTART_JOB, None, "WorkerFailed")),
    ("a spec error: no restart alone cures it", {"node_2": failed(2, "invalid job: spec.data")},
     {}, Memory(), set(), (Act.RESTART_JOB, None, "WorkerFailed")),
    ("the other cluster is finishing: wait for it, the job then ends without the lost one",
     {"node_2": KILLED, "node_5": SUCCEEDED}, {}, Memory(), set(),
     (Act.WAIT, None, "OthersFinishing")),
    ("the other cluster is finishing, recovery job: every worker restarts",
     {"node_2": KILLED, "node_5": SUCCEEDED}, {"recovery": "job"}, Memory(), set(),
     (Act.RESTART_JOB, None, "WorkerFailed")),
    ("a worker of the finishing cluster is lost too: every worker restarts",
     {"node_2": KILLED, "node_5": SUCCEEDED, "node_0": KILLED}, {}, Memory(), set(),
     (Act.RESTART_JOB, None, "WorkerFailed")),
    ("the other cluster is rejoining: not whole", {"node_2": KILLED}, {}, Memory(), {0},
     (Act.RESTART_JOB, None, "WorkerFailed")),
    ("both clusters lost workers", {"node_2": KILLED, "node_5": KILLED}, {}, Memory(), set(),
     (Act.RESTART_JOB, None, "WorkerFailed")),
    ("recoveryLimit reached", {"node_2": KILLED}, {"recoveryLimit": 2}, Memory(recoveries=2),
     set(), (Act.RESTART_JOB, None, "WorkerFailed")),
    ("the cluster failed as it did before its last restart alone: the whole job restarts",
     {"node_2": failed()}, {}, Memory(recoveries=1, cluster_failed_as={1: f"exit code 1: {BOOM}"}),
     set(), (Act.RESTART_JOB, None, "WorkerFailed")),
    ("another failure of a cluster restarted alone before: alone again",
     {"node_2": failed(1, "OSError: disk full")}, {},
     Memory(recoveries=1, cluster_failed_as={1: f"exit code 1: {BOOM}"}), set(),
     (Act.RESTART_CLUSTER, 1, "WorkerFailed")),
    ("the job failed as it did before its last whole restart: it fails",
     {"node_2": failed()}, {"recovery": "job"},
     Memory(restarts=1, failed_as=f"exit code 1: {BOOM}"), set(),
     (Act.FAIL, None, "RepeatedFailure")),
    ("killed again and again: never taken for a repeat", {"node_2": KILLED}, {"recovery": "job"},
     Memory(restarts=1, failed_as=None), set(), (Act.RESTART_JOB, None, "WorkerFailed")),
    ("backoffLimit used up", {"node_2": KILLED}, {"recovery": "job"}, Memory(restarts=3), set(),
     (Act.FAIL, None, "BackoffLimitExceeded")),
]


@pytest.mark.parametrize(("name", "states", "policy", "memory", "rejoining", "expected"),
                         SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_both_supervisors_decide_a_loss_alike(plan, tmp_path, name, states, policy, memory,
                                              rejoining, expected):
    run_policy = RunPolicy.model_validate(policy)
    decided = []
    for seen in (by_operator(plan, states), by_local_runner(plan, states, tmp_path)):
        down = [s for s in seen.values() if s.phase == NodePhase.FAILED]
        decided.append(after_loss(plan, run_policy, seen, down, "lost", memory,
                                  rejoining=rejoining))
    operator, runner = decided
    assert dataclasses.astuple(operator) == dataclasses.astuple(runner), name
    assert (operator.act, operator.cluster, operator.reason) == expected, name


def test_what_each_decision_says_and_remembers(plan, tmp_path):
    seen = by_local_runner(plan, {"node_2": failed()}, tmp_path)
    down = [seen["node_2"]]
    policy = RunPolicy()
    alone = after_loss(plan, policy, seen, down, "worker node_2 exited with code 1", Memory())
    assert alone.said(taken="; spare spare_7 took over the stage of node_2") == (
        "worker node_2 exited with code 1; cluster 1 restarted alone (recovery 1/10); spare "
        "spare_7 took over the stage of node_2: it takes its state from cluster(s) 0 and rejoins "
        "at a round boundary, while they train on")
    assert alone.memory == Memory(recoveries=1, cluster_failed_as={1: f"exit code 1: {BOOM}"})
    # the same failure again: the whole job restarts, remembering it
    whole = after_loss(plan, policy, seen, down, "lost", alone.memory)
    assert whole.said(resumes="resumes from checkpoint at step 40") == (
        "lost; restart 1/3 resumes from checkpoint at step 40")
    assert whole.memory == dataclasses.replace(alone.memory, restarts=1,
                                               failed_as=f"exit code 1: {BOOM}")
    # and once more: restarting cannot cure it
    fail = after_loss(plan, policy, seen, down, "lost", whole.memory)
    assert fail.act == Act.FAIL and fail.memory == whole.memory
    assert fail.said() == ("lost after 1 restart(s), backoffLimit 3; it failed the same way as "
                           "before its last restart, so it is not restarted again")
    assert after_loss(plan, RunPolicy(backoff_limit=0, recovery="job"), seen, down, "lost",
                      Memory()).said() == "lost"
    seen = by_local_runner(plan, {"node_2": failed(), "node_5": SUCCEEDED}, tmp_path)
    wait = after_loss(plan, policy, seen, down, "lost", Memory())
    assert (wait.act, wait.memory, wait.said()) == (Act.WAIT, Memory(), (
        "lost; cluster(s) 0 finishing: the job ends without the lost cluster once they have "
        "finished"))


@pytest.mark.parametrize(("code", "message", "known"), [
    (1, BOOM, f"exit code 1: {BOOM}"),
    (1, f"Traceback...\n2026-11-28 07:00:01,123 {BOOM}\n", f"exit code 1: {BOOM}"),
    (137, "", None),  # killed (a pod's container)
    (-9, "", None),  # killed (a local process)
    (1, "", None),  # said nothing
    (None, "", None),  # still running
])
def test_a_failure_is_known_by_its_exit_code_and_last_words(code, message, known):
    assert failed_as(termination.Ending(code, message=message)) == known


def test_a_local_worker_that_left_no_message_is_known_by_its_log(tmp_path):
    log = tmp_path / "node_1.log"
    termination.local_env({}, log)
    log.write_text(f"2026-11-28 07:00:00,000 INFO start\n2026-11-28 07:00:01,000 {BOOM}\n")
    assert failed_as(local.ending_of(log, 1)) == f"exit code 1: {BOOM}"
    assert local.ending_of(log, None) == termination.Ending(None)


DONE = {"node_0": finished([0]), "node_5": finished([0])}
"""Cluster 0 finished, its final round held itself alone."""
# (scenario, node states, runPolicy, clusters restarted alone, rejoining, abandoned before)
#   -> (the clusters the job ends without, new, why) or None
ENDINGS: list[tuple[str, dict[str, Any], dict[str, Any], set[int], set[int], set[int], Any]] = [
    ("cluster 1 failed after cluster 0 finished", {**DONE, "node_3": failed()}, {}, set(), set(),
     set(), ({1}, {1}, FAILED_AFTER)),
    ("the same with recovery job: no", {**DONE, "node_3": failed()}, {"recovery": "job"}, set(),
     set(), set(), None),
    ("cluster 1, restarted alone, runs again after cluster 0's final round", DONE, {}, {1}, set(),
     set(), ({1}, {1}, TOO_LATE)),
    ("cluster 1 rejoined at cluster 0's final round: waited for",
     {"node_0": finished([0, 1]), "node_5": finished([0, 1])}, {}, {1}, set(), set(), None),
    ("an older worker says nothing of its final round: waited for",
     {"node_0": finished(), "node_5": finished()}, {}, {1}, set(), set(), None),
    ("cluster 1 never restarted, still running: waited for", DONE, {}, set(), set(), set(), None),
    ("cluster 1 restarted alone, not running again yet", {**DONE, "node_3": KILLED}, {}, {1}, {1},
     set(), ({1}, {1}, NOT_BACK)),
    ("cluster 0 not finished yet", {"node_0": finished([0]), "node_3": failed()}, {}, set(),
     set(), set(), None),
    ("cluster 1 was left out already", {**DONE, "node_3": failed()}, {}, set(), set(), {1}, None),
]


@pytest.mark.parametrize(("name", "states", "policy", "recovered", "rejoining", "abandoned",
                          "expected"), ENDINGS, ids=[e[0] for e in ENDINGS])
def test_both_supervisors_end_a_job_without_the_same_clusters(plan, tmp_path, name, states,
                                                              policy, recovered, rejoining,
                                                              abandoned, expected):
    run_policy = RunPolicy.model_validate(policy)
    decided = [ends_without(plan, run_policy, seen, recovered=recovered, rejoining=rejoining,
                            abandoned=abandoned)
               for seen in (by_operator(plan, states), by_local_runner(plan, states, tmp_path))]
    assert decided[0] == decided[1], name
    ends = decided[0]
    if expected is None:
        assert ends is None, name
        return
    assert ends is not None, name
    clusters, new, why = expected
    assert (ends.clusters, ends.new, ends.done, ends.why) == (clusters, new, {0}, why), name
    assert ends.said() == (f"cluster(s) 1 could not rejoin before the others finished ({why}): "
                           f"the job ends without them, with the model of cluster(s) 0, which "
                           f"the final round averaged")


CLUSTER_1 = ("node_1", "node_2", "node_3", "node_4")
# (scenario, node states, rejoining) -> the clusters back
BACK: list[tuple[str, dict[str, Any], set[int], set[int]]] = [
    ("cluster 1's workers all run again: back", {}, {1}, {1}),
    ("one of them failed again: not back", {"node_3": KILLED}, {1}, set()),
    ("they finished (rejoined for the final state): back", dict.fromkeys(CLUSTER_1, SUCCEEDED),
     {1}, {1}),
    ("no cluster rejoining", {}, set(), set()),
]


@pytest.mark.parametrize(("name", "states", "rejoining", "expected"), BACK,
                         ids=[b[0] for b in BACK])
def test_both_supervisors_take_a_cluster_back_alike(plan, tmp_path, name, states, rejoining,
                                                    expected):
    for seen in (by_operator(plan, states), by_local_runner(plan, states, tmp_path)):
        assert back_again(rejoining, seen) == expected, name
    left = rejoining - expected
    assert clusters_active(plan, left) == f"{2 - len(left)}/2"


def test_what_a_supervisor_says_when_the_clusters_restarted_alone_are_back():
    said = "worker node_2 exited with code -9; cluster 1 restarted alone (recovery 1/3)"
    assert REJOINED == "Rejoined"
    assert rejoined({1}, {"type": "Recovering", "status": "True", "message": said}) == \
        f"cluster(s) 1 running again after: {said}"


def test_a_job_fails_past_its_deadline_and_says_so():
    assert past_deadline(None, 10**9) is None and past_deadline(60, 60) is None
    assert past_deadline(60, 60.5) == "job ran longer than activeDeadlineSeconds=60"


def test_what_a_supervisor_remembers_goes_through_a_job_status_unchanged():
    memory = Memory(restarts=2, recoveries=3, failed_as=f"exit code 1: {BOOM}",
                    cluster_failed_as={2: "exit code 3: x"})
    status = {"restarts": 2, "recoveries": 3, "lastFailures": memory.last_failures()}
    assert status["lastFailures"] == {"job": f"exit code 1: {BOOM}",
                                      "clusters": [None, None, "exit code 3: x"]}
    assert Memory.of_status(status) == memory
    assert Memory().last_failures() is None and Memory.of_status({}) == Memory()
    # what is not of its type is ignored (a status edited by hand)
    assert Memory.of_status({"lastFailures": {"job": 7, "clusters": {"0": "x"}}}) == Memory()


# (scenario, node states, when nodes ended (s), runPolicy, rejoining, drained, abandoned before,
#  seconds running) -> (clusters newly ended without, nodes down, act, done, clusters back, past)
PASSES: list[tuple[str, dict[str, Any], dict[str, float], dict[str, Any], set[int], set[int],
                   set[int], float, Any]] = [
    ("every worker runs: watch on", {}, {}, {}, set(), set(), set(), 5.0,
     (None, (), None, False, set(), None)),
    ("one killed: its cluster alone", {"node_2": KILLED}, {}, {}, set(), set(), set(), 5.0,
     (None, ("node_2",), Act.RESTART_CLUSTER, False, set(), None)),
    ("two failed: every one is down, the first to end first (its words are the failure's)",
     {"node_2": failed(1, "ValueError: late"), "node_3": failed(1, "OSError: first")},
     {"node_2": 30, "node_3": 10}, {}, set(), set(), set(), 5.0,
     (None, ("node_3", "node_2"), Act.RESTART_CLUSTER, False, set(), None)),
    ("all succeeded: done", dict.fromkeys(("node_0", "node_1", "node_2", "node_3", "node_4",
                                           "node_5"), SUCCEEDED), {}, {}, set(), set(), set(),
     5.0, (None, (), None, True, set(), None)),
    ("cluster 1 failed after cluster 0 finished: ended without it, and so done",
     {**DONE, "node_3": failed()}, {}, {}, set(), set(), set(), 5.0,
     ({1}, (), None, True, set(), None)),
    ("cluster 1 restarted alone runs again: back", {}, {}, {}, {1}, set(), set(), 5.0,
     (None, (), None, False, {1}, None)),
    ("a failure in a drained cluster is none", {"node_3": failed()}, {}, {}, set(), {1}, set(),
     5.0, (None, (), None, False, set(), None)),
    ("a failure in a cluster left out before is none", {**DONE, "node_3": failed()}, {}, {},
     set(), set(), {1}, 5.0, (None, (), None, True, set(), None)),
    ("past the deadline", {}, {}, {"activeDeadlineSeconds": 60}, set(), set(), set(), 61.0,
     (None, (), None, False, set(), "job ran longer than activeDeadlineSeconds=60")),
    ("a loss comes before the deadline", {"node_2": KILLED}, {},
     {"activeDeadlineSeconds": 60}, set(), set(), set(), 61.0,
     (None, ("node_2",), Act.RESTART_CLUSTER, False, set(), None)),
]


@pytest.mark.parametrize(("name", "states", "ended", "policy", "rejoining", "drained",
                          "abandoned", "seconds", "expected"), PASSES,
                         ids=[p[0] for p in PASSES])
def test_both_supervisors_decide_a_pass_alike(plan, tmp_path, name, states, ended, policy,
                                              rejoining, drained, abandoned, seconds, expected):
    """One pass over a running job (`decide_running`): the same decision from the operator's
    pods and the local runner's processes, in the same order."""
    run_policy = RunPolicy.model_validate(policy)
    told: list[tuple[str, ...]] = []
    decided = []
    for seen in (by_operator(plan, states, ended), by_local_runner(plan, states, tmp_path, ended)):
        decided.append(decide_running(
            plan, run_policy, seen, Memory(), lambda down: told.append(
                tuple(s.node for s in down)) or "lost", rejoining=rejoining, drained=drained,
            abandoned=abandoned, recovered=rejoining, seconds_running=seconds))
    operator, runner = decided
    new, down, act, done, back, past = expected
    for d in decided:
        assert (d.ends.new if d.ends else None, tuple(s.node for s in d.down),
                d.loss.act if d.loss else None, d.done, d.back, d.past) == (
            new, down, act, done, back, past), name
    assert operator.loss == runner.loss and operator.ends == runner.ends, name
    assert told == ([down, down] if down else []), name
    if down and isinstance(states[down[0]], tuple):  # (killed: known by nothing)
        # the first to end is the one whose words the failure is known by
        assert runner.loss is not None and runner.loss.memory.cluster_failed_as == {
            1: f"exit code 1: {states[down[0]][1]}"}, name


def test_a_pod_deleted_or_gone_is_lost_once_the_job_runs_a_process_ends(plan):
    """A pod being deleted, or gone, from a running job is lost like a failed one; before the job
    runs it is one still being made (or an earlier attempt's), and a local worker's process never
    vanishes (`vanished_lost`)."""
    pods = [_pod(n, RUNNING) for n in plan.names() if n != "node_4"]
    pods[1]["metadata"]["deletionTimestamp"] = "2026-11-28T07:00:00Z"  # node_1's
    seen = {n: s.seen(n) for n, s in statuses.observe("digits", plan, pods).nodes.items()}
    decided = decide_running(plan, RunPolicy(), seen, Memory(), lambda down: "lost")
    assert [s.node for s in decided.down] == ["node_1", "node_4"]
    assert decided.loss is not None and decided.loss.act == Act.RESTART_CLUSTER
    assert decided.loss.cluster == 1
    quiet = decide_running(plan, RunPolicy(), seen, Memory(), lambda down: "lost",
                           vanished_lost=False)
    assert quiet.down == () and quiet.loss is None and not quiet.done
    # a cluster restarted alone has no pods until they are made again: not lost
    back = decide_running(plan, RunPolicy(), seen, Memory(), lambda down: "lost", rejoining={1})
    assert [s.node for s in back.down] == ["node_1"]


def test_both_supervisors_give_a_lost_stage_to_a_free_spare_at_a_whole_restart(tmp_path):
    """At a whole restart (runPolicy.recovery: job), a free hot spare that holds a lost node's
    stage runs it from then on, and the lost provider becomes a spare: the local runner as the
    operator (tests/unit/test_operator_decide.py), and both say so alike."""
    import subprocess
    import sys

    doc = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())
    doc["spec"]["plan"]["spares"] = 1
    doc["spec"]["runPolicy"] = {"recovery": "job"}
    run = local.LocalRun(parse_job(doc), tmp_path, progress=False)
    run.prepare()
    assert run.plan is not None
    (spare,) = run.spares
    victim = run.plan.nodes[0]
    held = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        run.spare_procs = {spare.name: local._Proc(spare.name, held, tmp_path / "s.log", 0)}
        taken = run._reassign([seen_in_process(victim.name, victim.cluster, -9,
                                               termination.Ending(-9))])
    finally:
        held.kill()
        held.wait()
    assert taken == {victim.name: spare.name}
    assert run._runs_on(victim.name) == spare.provider  # its worker starts there
    assert [sp.provider for sp in run.spares] == [victim.provider]  # the lost one: a spare
    assert run.takeovers[0]["node"] == victim.name and run.takeovers[0]["lost"] == \
        victim.provider
    after = after_loss(run.plan, run.job.spec.run_policy, {}, [], "worker node_0 exited with "
                       "code -9", Memory())
    assert after.act == Act.RESTART_JOB
    assert after.said(elastic.taken_over(taken), resumes="resumes from the start") == (
        f"worker node_0 exited with code -9; restart 1/3 resumes from the start; spare "
        f"{spare.name} took over the stage of node_0")
    # a spare not running (its process ended) takes nothing over
    run.spare_procs = {}
    assert run._reassign([seen_in_process("node_1", 1, -9, termination.Ending(-9))]) == {}


def test_a_pass_says_whether_every_worker_runs(plan, tmp_path):
    """`Running.up`, from both supervisors' observations: every worker of the job runs or
    finished (the clusters the job ends without left out), when Restarting turns False in both."""
    for seen in (by_operator(plan, {}, {}), by_local_runner(plan, {}, tmp_path, {})):
        assert decide_running(plan, RunPolicy(), seen, Memory(), lambda down: "lost").up
    pods = [_pod(n, RUNNING) for n in plan.names()]
    pods[2]["status"]["phase"] = "Pending"
    seen = {n: s.seen(n) for n, s in statuses.observe("digits", plan, pods).nodes.items()}
    assert not decide_running(plan, RunPolicy(), seen, Memory(), lambda down: "lost").up
    # cluster 1 restarted alone, its pods not made again yet: the job is not all up
    pods = [_pod(n, RUNNING) for n in plan.names() if n in plan.clusters[0].nodes]
    seen = {n: s.seen(n) for n, s in statuses.observe("digits", plan, pods).nodes.items()}
    decided = decide_running(plan, RunPolicy(), seen, Memory(), lambda down: "lost",
                             rejoining={1}, recovered=[1])
    assert decided.loss is None and not decided.up
    # ... but a job that ends without a cluster is up once the others run
    decided = decide_running(plan, RunPolicy(), seen, Memory(), lambda down: "lost",
                             abandoned={1})
    assert decided.up and decided.away == {1}


def _types(conditions):
    return {c["type"]: (c["status"], c["reason"], c["message"], c["lastTransitionTime"])
            for c in conditions}


def test_both_supervisors_turn_a_decision_into_the_same_conditions(plan):
    """The conditions each decision sets (the operator's job status and the local runner's
    status.json take them from here): a job running, restarted whole, running again; a cluster
    restarted alone and back; one the job waits on and then ends without; a job that fails."""
    policy = RunPolicy()
    conds = all_running([], "WorkersRunning", "6 worker processes running", "T0")
    assert _types(conds) == {"Running": ("True", "WorkersRunning", "6 worker processes running",
                                         "T0")}
    whole = after_loss(plan, policy, {}, [], "worker node_0 exited with code -9", Memory())
    assert whole.act == Act.RESTART_JOB
    conds = on_loss(conds, whole, "restart 1/3", "T1")
    assert _types(conds)["Restarting"] == ("True", "WorkerFailed", "restart 1/3", "T1")
    conds = all_running(conds, "WorkersRunning", "6 worker processes running", "T2")
    assert _types(conds) == {
        "Running": ("True", "WorkersRunning", "6 worker processes running", "T0"),
        "Restarting": ("False", RECOVERED, "running again after: restart 1/3", "T2")}
    alone = AfterLoss(Act.RESTART_CLUSTER, Memory(recoveries=1), "lost", cluster=1,
                      whole=(0,), limit=3)
    conds = on_loss(conds, alone, "cluster 1 restarted alone", "T3")
    assert _types(conds)["Recovering"] == ("True", "WorkerFailed", "cluster 1 restarted alone",
                                           "T3")
    assert on_back(conds, {1}, {2}, "T4") == conds  # (one still rejoining)
    assert on_back(conds, set(), set(), "T4") == conds
    back = on_back(conds, {1}, set(), "T4")
    assert _types(back)["Recovering"] == (
        "False", REJOINED, "cluster(s) 1 running again after: cluster 1 restarted alone", "T4")
    assert on_back(back, {1}, set(), "T5") == back  # (said once)
    wait = AfterLoss(Act.WAIT, Memory(), "lost", whole=(0,))
    conds = on_loss(back, wait, wait.said(), "T5")
    assert _types(conds)["Recovering"][:2] == ("True", "OthersFinishing")
    ends = ends_without(plan, policy, by_operator(plan, {**DONE, "node_3": failed()}, {}),
                        recovered=[])
    assert ends is not None
    conds = on_ends_without(conds, ends, "T6")
    assert _types(conds)["Recovering"] == ("False", "Abandoned", ends.said(), "T6")
    final = AfterLoss(Act.FAIL, Memory(restarts=3), "lost", limit=3)
    conds = on_loss(conds, final, final.said(), "T7")
    assert _types(conds)["Failed"] == ("True", "BackoffLimitExceeded",
                                       "lost after 3 restart(s), backoffLimit 3", "T7")
    assert _types(conds)["Running"] == ("False", "BackoffLimitExceeded", "", "T7")
    assert supervising.failed([], "DeadlineExceeded", "too long", "T8") == [
        {"type": "Failed", "status": "True", "reason": "DeadlineExceeded",
         "message": "too long", "lastTransitionTime": "T8"},
        {"type": "Running", "status": "False", "reason": "DeadlineExceeded", "message": "",
         "lastTransitionTime": "T8"}]


def _evicted(pod: dict[str, Any], reason: str = "EvictionByEvictionAPI") -> dict[str, Any]:
    """A pod as the apiserver leaves it once it is evicted: DisruptionTarget, being deleted."""
    pod["metadata"]["deletionTimestamp"] = "2026-11-28T07:00:00Z"
    pod["status"]["conditions"] = [{"type": "Ready", "status": "True"},
                                   {"type": "DisruptionTarget", "status": "True",
                                    "reason": reason, "message": "Eviction API: evicting"}]
    return pod


def _seen(plan, pods, disrupted=None):
    return {n: s.seen(n) for n, s in statuses.observe("digits", plan, pods, disrupted)
            .nodes.items()}


def test_an_evicted_pod_restarts_the_job_without_counting_against_backoff_limit(plan):
    """backoffLimit 0: a failure fails the job at once; evictions (a drain), preemptions and a
    node's kubelet evicting restart it, again and again, the restarts remembered apart."""
    policy = RunPolicy(recovery="job", backoff_limit=0)
    memory = Memory()
    for reason in ("EvictionByEvictionAPI", "PreemptionByScheduler", "TerminationByKubelet"):
        pods = [_pod(n, RUNNING) for n in plan.names()]
        _evicted(pods[2], reason)
        states = statuses.observe("digits", plan, pods).nodes
        decided = decide_running(plan, policy, _seen(plan, pods), memory,
                                 lambda down, states=states: "; ".join(
                                     states[s.node].failure() for s in down))
        loss = decided.loss
        assert loss is not None and loss.act == Act.RESTART_JOB and loss.disruption
        assert loss.reason == "Disrupted"
        assert loss.failure == f"pod digits-node-2 was disrupted ({reason})"
        assert "a disruption, not counted against backoffLimit" in loss.said()
        memory = loss.memory
    assert (memory.restarts, memory.disrupted_restarts, memory.counted_restarts) == (3, 3, 0)
    assert memory.disruptions() == {"restarts": 3, "recoveries": 0}
    assert Memory.of_status({"restarts": 3, "disruptions": memory.disruptions()}) == memory
    # a failure now is the first one counted: backoffLimit 0 fails the job
    pods = [_pod(n, RUNNING) for n in plan.names()]
    pods[2] = _pod("node_2", failed())
    failure = decide_running(plan, policy, _seen(plan, pods), memory, lambda down: "boom").loss
    assert failure is not None and failure.act == Act.FAIL and not failure.disruption
    assert failure.said() == "boom"  # (no "after N restart(s)": none counted, backoffLimit 0)


def test_a_pod_evicted_by_its_kubelet_or_gone_after_a_disruption_is_disrupted(plan):
    """A kubelet's eviction leaves the pod Failed with reason Evicted; a pod the watch saw
    disrupted may be gone by the pass (`disrupted`); with a failed one beside it, the loss is a
    failure."""
    pods = [_pod(n, RUNNING) for n in plan.names() if n != "node_3"]
    pods[1]["status"] = {"phase": "Failed", "reason": "Evicted",
                         "message": "The node was low on resource: memory."}
    seen = _seen(plan, pods, {resources.pod_name("digits", "node_3"): "PreemptionByScheduler"})
    assert seen["node_1"].disrupted == "Evicted"
    assert seen["node_3"].disrupted == "PreemptionByScheduler"
    decided = decide_running(plan, RunPolicy(), seen, Memory(recoveries=5), lambda d: "gone")
    # one cluster lost, the other whole: it restarts alone, recoveryLimit (5) not counting it
    assert decided.loss is not None and decided.loss.act == Act.RESTART_CLUSTER
    assert decided.loss.disruption and decided.loss.cluster == 1
    assert decided.loss.memory.disrupted_recoveries == 1
    assert decided.loss.memory.counted_recoveries == 5
    assert "not counted against recoveryLimit" in decided.loss.said()
    pods.append(_pod("node_3", failed()))
    mixed = decide_running(plan, RunPolicy(recovery="job"), _seen(plan, pods), Memory(),
                           lambda d: "x").loss
    assert mixed is not None and not mixed.disruption and mixed.memory.disrupted_restarts == 0


def test_a_status_cannot_claim_more_disruptions_than_restarts():
    memory = Memory.of_status({"restarts": 1, "recoveries": 0,
                               "disruptions": {"restarts": 9, "recoveries": 4}})
    assert (memory.disrupted_restarts, memory.disrupted_recoveries) == (1, 0)
    assert Memory.of_status({"restarts": True, "disruptions": "x"}) == Memory()
