"""Elastic training on `ravnest run` (issue 20): a 3-cluster digits job whose root is killed with
SIGKILL at a seeded random step. The runner restarts only the lost
cluster; the other two train on (their step counters, read from their metrics while the cluster
is away, keep rising and never go back: they redo no step), their rounds go on without it; the
restarted workers take their state from the other clusters' nodes, not from a checkpoint, and
rejoin at a round boundary. Every cluster then ends the job with the same weights, at an accuracy
within 1 % of an undisturbed run of the same job. Recovery times and the bytes moved are
printed.

The jobs are short (20 epochs, 280 updates per cluster; they were 60): from the kill (or the grow
order) until the lost (or added) cluster is back, the leaves take 50 ms more per micro-batch
(gated_loss's slow gate), so the others keep training, slowly enough that they cannot finish
first however slowly the machine starts the cluster; once it is back, they train at full speed.

A stem's and a leaf's live rejoin have their real runs on the other executors: the operator tier
kills a stem (tests/integration/test_operator.py, elastic-node-3) and the kind tier deletes a
leaf's pod (tests/e2e/test_cluster.py). Each role's run here cost about 55 s of CI.

Growing a running job (`ravnest grow`) has its one real run here; draining one has it in the
operator tier (test_operator.py, where the survivors' logs are checked as they were here), and
`ravnest drain`'s answers are tested on a held run folder (tests/unit/test_orders.py): the run of
it here, a 60-epoch job restarted once, cost 97 s of a cold CI run.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from elastic_job import elastic_job, local_run, planned, steps, wait
from gated_loss import SLOW
from processes import worker_pid

from ravnest.run.progress import scrape
from ravnest.train.fusing import fuse_stage_files

EPOCHS = 20
PER_EPOCH = 1437 // (3 * 32)  # batches (= updates, updateFrequency 1) per epoch per cluster
TOTAL = EPOCHS * PER_EPOCH


CRITERION = {"name": "gated_loss:criterion"}
"""(cross-entropy, as the undisturbed run's; slowed while the gate's SLOW file exists)"""


def _run(tmp: Path, role: str | None, seed: int, gate: Path | None = None) -> dict[str, Any]:
    """One run; with `role`, a node of that role in a random cluster is killed at a random step,
    and the survivors' steps are sampled (slowed by `gate`'s SLOW file) until the lost cluster
    rejoined."""
    out = tmp / "out"
    # no checkpoints: nothing to fall back on, the state is live
    job = elastic_job(tmp, EPOCHS, {"everySteps": 0},
                      criterion=CRITERION if role is not None else None)
    got: dict[str, Any] = {"out": out}
    if role is not None:
        # slowed from the start: the join round is picked seconds ahead from how fast rounds
        # went, and on a fast machine rounds that quick put it past the job's end
        assert gate is not None
        Path(f"{gate}{SLOW}").touch()
    with local_run(job, out) as run:
        if role is not None:
            assert gate is not None
            got.update(_kill(run, out, role, random.Random(seed), Path(f"{gate}{SLOW}")))
        _, got["err"] = run.communicate(timeout=900)
    got["returncode"] = run.returncode
    return got


def _kill(run: subprocess.Popen[str], out: Path, role: str, rng: random.Random, slow: Path
          ) -> dict[str, Any]:
    plan, ports = planned(run, out)
    nodes = plan["nodes"]
    victim = rng.choice([n for n in nodes if n["role"] == role])
    lost = {n["name"] for n in nodes if n["cluster"] == victim["cluster"]}
    survivors = {n: p for n, p in ports.items() if n not in lost}
    at = rng.randint(40, 60)
    deadline = time.monotonic() + 300
    while not ((s := steps(ports)) and len(s) == len(ports) and min(s.values()) >= at):
        assert run.poll() is None and time.monotonic() < deadline, f"step {at} not reached"
        time.sleep(0.1)
    pid = worker_pid(out / "nodes" / f"{victim['name']}.json")
    assert pid is not None
    slow.touch()
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    samples = [(0.0, steps(survivors))]
    root = next(n["name"] for n in nodes if n["cluster"] == victim["cluster"]
                and n["role"] == "root")
    rejoined = None
    while rejoined is None:
        assert run.poll() is None, "the run ended before the lost cluster rejoined"
        assert time.monotonic() - killed < 300, "the lost cluster did not rejoin"
        samples.append((time.monotonic() - killed, steps(survivors)))
        try:
            if scrape(ports[root], timeout=0.5).get("ravnest_recoveries_total", 0) >= 1:
                rejoined = time.monotonic() - killed
        except OSError:
            pass
        time.sleep(0.25)
    slow.unlink()
    return {"victim": victim["name"], "cluster": victim["cluster"], "lost": lost, "at": at,
            "survivors": sorted(survivors), "samples": samples, "rejoined_after": rejoined}


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    got = _run(tmp_path_factory.mktemp("undisturbed"), None, 0)
    assert got["returncode"] == 0, got["err"][-3000:]
    return json.loads((got["out"] / "summary.json").read_text())


@pytest.mark.parametrize("role,seed", [("root", 1)])
def test_a_killed_node_costs_only_its_cluster_which_rejoins_live(tmp_path, undisturbed, gate,
                                                                 role, seed):
    got = _run(tmp_path, role, seed, gate)
    out, err = got["out"], got["err"]
    assert got["returncode"] == 0, err[-3000:]
    status = json.loads((out / "status.json").read_text())
    assert status["phase"] == "Succeeded"
    assert status["restarts"] == 0 and status["recoveries"] == 1, status
    assert f"worker {got['victim']} exited with code -9; cluster {got['cluster']} restarted " \
           f"alone" in err
    # as the operator says it: the cluster is back, none rejoining, every cluster training
    (recovering,) = [c for c in status["conditions"] if c["type"] == "Recovering"]
    assert recovering["status"] == "False" and recovering["reason"] == "Rejoined", status
    assert recovering["message"].startswith(
        f"cluster(s) {got['cluster']} running again after: worker {got['victim']} exited")
    assert "rejoining" not in status and status["clusters"] == "3/3", status

    # the survivors never stopped and never went back while the cluster was away
    samples = got["samples"]
    for n in got["survivors"]:
        seen = [s[n] for _, s in samples if n in s]
        assert seen == sorted(seen), (n, seen)
        assert seen[-1] >= seen[0] + 20, (n, seen)  # (20 updates: 10 rounds, reduceFactor 2)
    logs = {n.stem: n.read_text() for n in (out / "logs").glob("*.log")}
    for n in got["survivors"]:
        assert "resumed from checkpoint" not in logs[n] and "rejoined" not in logs[n]
        # no round waited out its timeout: the loss was seen by the watches, and the first
        # round after the rejoin did not send to the lost process's connection
        assert "within 30s" not in logs[n], logs[n][-3000:]

    # the lost cluster took its state from the others and rejoined at one round
    joins = {n: re.search(r"rejoined after round (\d+) at update (\d+): (\d+) bytes of state "
                          r"from (.*) in ([\d.]+) s", logs[n]) for n in got["lost"]}
    assert all(joins.values()), {n: logs[n][-2000:] for n, j in joins.items() if not j}
    assert len({j[1] for j in joins.values() if j}) == 1, joins
    moved = sum(int(j[3]) for j in joins.values() if j)
    assert moved > 0

    # every cluster finished every update, all of them in the final round (the workers'
    # termination messages say), and ends with the same weights
    said = [json.loads((out / "logs" / f"{n}.termination").read_text())
            for n in got["survivors"]]
    assert {s["updates"] for s in said} == {TOTAL} and _final_rounds(said) == {(0, 1, 2)}, said
    summary = json.loads((out / "summary.json").read_text())
    assert summary["clusters"] == 3 and summary["updates"] == TOTAL
    assert str(got["cluster"]) in summary["rejoined"]
    copies = [fuse_stage_files(out / "stages", c) for c in range(3)]
    for other in copies[1:]:
        for k, v in copies[0].items():
            torch.testing.assert_close(other[k].float(), v.float(), rtol=0, atol=1e-6, msg=k)
    accuracy, reference = summary["fused_val_metric"], undisturbed["fused_val_metric"]
    assert abs(accuracy - reference) <= 0.01, (accuracy, reference)
    rises = {n: [s[n] for _, s in samples if n in s] for n in got["survivors"]}
    print(f"\n{role} {got['victim']} (cluster {got['cluster']}) killed at step {got['at']}: "
          f"rejoined after {got['rejoined_after']:.1f} s at update {next(iter(joins.values()))[2]}"
          f", {moved} bytes of state moved; survivors' steps during it "
          f"{ {n: (v[0], v[-1]) for n, v in rises.items()} }; accuracy {accuracy:.4f} "
          f"(undisturbed {reference:.4f}); partial rounds {summary['rounds_partial']}")


def _final_rounds(said: list[dict[str, Any]]) -> set[tuple[int, ...]]:
    """The clusters in the final round of each node of `said` (termination messages) that
    had one (a node sharing no parameters is in no ring)."""
    return {tuple(s["final_clusters"]) for s in said if "final_clusters" in s}


def test_a_cluster_back_too_late_for_the_final_round_is_left_out_when_the_others_finish(
        tmp_path):
    """A worker of cluster 2 is killed; the runner restarts that cluster, whose new workers are
    slow to come up (stopped as soon as they start, as on a loaded machine) until clusters 0 and 1
    have finished. Their nodes' termination messages say their final round held clusters 0 and 1
    only, so the run ends without cluster 2 as soon as they exit, with their model: not when the
    new workers' wait for the finished ones runs out (their peer timeout, 5 minutes)."""
    out = tmp_path / "out"
    stopped: dict[str, int] = {}
    try:
        with local_run(elastic_job(tmp_path, 12, {"everySteps": 0}), out) as run:
            plan, leaving, survivors = _at_step(run, out, 30)
            files = {n: out / "nodes" / f"{n}.json" for n in leaving}
            old = {n: worker_pid(f) for n, f in files.items()}
            victim = next(n["name"] for n in plan["nodes"]
                          if n["cluster"] == 2 and n["role"] == "leaf")
            os.kill(old[victim] or 0, signal.SIGKILL)
            deadline = time.monotonic() + 120
            while set(stopped) != leaving:
                assert run.poll() is None and time.monotonic() < deadline, \
                    f"cluster 2 not restarted: {sorted(stopped)}"
                for n in leaving - set(stopped):
                    pid = worker_pid(files[n])
                    if pid is not None and pid != old[n]:
                        os.kill(pid, signal.SIGSTOP)
                        stopped[n] = pid
                time.sleep(0.02)
            _, err = run.communicate(timeout=300)
    finally:
        for pid in stopped.values():  # (the runner kills them; a failed test must too)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert run.returncode == 0, err[-3000:]
    status = json.loads((out / "status.json").read_text())
    assert status["phase"] == "Succeeded" and status["restarts"] == 0, status
    assert status["recoveries"] == 1 and status["abandoned"] == [2], status
    assert "cluster(s) 2 could not rejoin before the others finished (restarted, and running " \
           "again only after the others' final round): the job ends without them, with the " \
           "model of cluster(s) 0, 1" in err, err[-3000:]
    said = [json.loads((out / "logs" / f"{n}.termination").read_text()) for n in survivors]
    assert {s["updates"] for s in said} == {12 * PER_EPOCH}
    assert _final_rounds(said) == {(0, 1)}, said
    summary = _same_model_of_clusters_0_and_1(out)
    assert summary["updates"] == 12 * PER_EPOCH


def _at_step(run: subprocess.Popen[str], out: Path, step: int
             ) -> tuple[dict[str, Any], set[str], dict[str, int]]:
    """Once every worker reached `step`: the plan, the nodes of cluster 2 (the one to drain) and
    the metrics ports of the others."""
    plan, ports = planned(run, out)
    wait(f"step {step}", lambda: len(s := steps(ports)) == len(ports) and min(
        s.values()) >= step, run)
    leaving = {n["name"] for n in plan["nodes"] if n["cluster"] == 2}
    return plan, leaving, {n: p for n, p in ports.items() if n not in leaving}


def _same_model_of_clusters_0_and_1(out: Path) -> dict[str, Any]:
    """The summary of a run that ended with clusters 0 and 1 (2 drained), which hold the same
    weights."""
    summary = json.loads((out / "summary.json").read_text())
    assert summary["clusters"] == 2
    copies = [fuse_stage_files(out / "stages", c) for c in (0, 1)]
    for k, v in copies[0].items():
        torch.testing.assert_close(copies[1][k].float(), v.float(), rtol=0, atol=1e-6, msg=k)
    return dict(summary)


def _at_step_40(run: subprocess.Popen[str], out: Path, job: Path
                ) -> tuple[dict[str, Any], dict[str, int], dict[str, Any], list[dict[str, Any]]]:
    """Once every worker reached step 40: the plan, the metrics ports, the job file's document
    and the nodes of cluster 0 (whose stages a cluster added takes)."""
    plan, ports = planned(run, out)
    wait("step 40", lambda: len(s := steps(ports)) == len(ports) and min(
        s.values()) >= 40, run)
    return (plan, ports, yaml.safe_load(job.read_text()),
            [n for n in plan["nodes"] if n["cluster"] == 0])


def _grow(out: Path, job: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ravnest", "grow", str(job), "-o", str(out)],
                          capture_output=True, text=True, timeout=60)


def test_providers_added_to_a_running_job_form_a_cluster_that_joins_and_trains(tmp_path,
                                                                              undisturbed, gate):
    """`ravnest grow` (issue 20, grow): providers listed after the running job's form a new
    cluster (the stages of a planned one) that joins at a round boundary with the latest state,
    while the others never stop; it trains its own data to the end, the final round averages all
    four, and an edit that is not an addition is refused with nothing ordered. (Growing's one real
    run: the kind tier's, a 50-epoch job of 181 s, went; tests/e2e/test_cluster.py says why.)"""
    out = tmp_path / "out"
    job = elastic_job(tmp_path, EPOCHS, {"everySteps": 0}, criterion=CRITERION)
    slow = Path(f"{gate}{SLOW}")
    slow.touch()  # (from the start, and until cluster 3 joined: see _run)
    with local_run(job, out) as run:
        plan, ports, doc, first = _at_step_40(run, out, job)
        doc["spec"]["providers"][0]["ram"] += 1  # (a change, not an addition)
        bad = tmp_path / "bad.yaml"
        bad.write_text(yaml.safe_dump(doc))
        refused = _grow(out, bad)
        assert refused.returncode == 2 and "spec.providers: a running job grows by providers " \
            "listed after its" in refused.stderr, refused.stderr
        assert not list((out / "grow").iterdir())  # nothing was ordered
        doc["spec"]["providers"][0]["ram"] -= 1
        doc["spec"]["providers"] += [{"ram": n["ram_gb"], "bandwidth": 1000} for n in first]
        grown = tmp_path / "grown.yaml"
        grown.write_text(yaml.safe_dump(doc))
        ordered = _grow(out, grown)
        assert ordered.returncode == 0, ordered.stderr
        added = range(len(plan["nodes"]), len(plan["nodes"]) + len(first))
        assert f"provider(s) {', '.join(map(str, added))} join" in ordered.stdout, ordered.stdout
        samples = [steps(ports)]
        joined = out / "drain" / "cluster_3.joined"
        while not joined.exists():
            assert run.poll() is None, f"the run ended before cluster 3 joined: " \
                f"{run.communicate()[1][-3000:]}"
            samples.append(steps(ports))
            time.sleep(0.25)
        slow.unlink()
        _, err = run.communicate(timeout=900)
    assert run.returncode == 0, err[-3000:]
    join = json.loads(joined.read_text())["round"]
    status = json.loads((out / "status.json").read_text())
    assert status["phase"] == "Succeeded" and status["restarts"] == status["recoveries"] == 0
    assert status["clusters"] == "4/4", status
    assert status["membership"]["versions"] == [
        {"version": 1, "fromRound": 1, "clusters": [0, 1, 2]},
        {"version": 2, "fromRound": join + 1, "clusters": [0, 1, 2, 3]}]
    for n in ports:  # the planned clusters' steps never stopped, nor went back
        seen = [s[n] for s in samples if n in s]
        assert seen == sorted(seen) and seen[-1] >= seen[0] + 10, (n, seen)
    logs = {n.stem: n.read_text() for n in (out / "logs").glob("*.log")}
    newcomers = [f"node_{p}" for p in added]
    for n in ports:
        assert "within 30s" not in logs[n] and "skipped" not in logs[n], logs[n][-3000:]
    for ring in json.loads((out / "nodes" / f"{newcomers[0]}.json").read_text())["plan"]["rings"]:
        for m in set(ring["members"]) - set(newcomers):
            assert any(f"{c} of cluster 3, added to the running job, introduced itself" in
                       logs[m] for c in newcomers), logs[m][-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["clusters"] == 4 and summary["updates"] == TOTAL
    copies = [fuse_stage_files(out / "stages", c) for c in range(4)]
    for copy in copies[1:]:  # the final round averaged all four
        for k, v in copies[0].items():
            torch.testing.assert_close(copy[k].float(), v.float(), rtol=0, atol=1e-6, msg=k)
    cluster3 = json.loads((out / "clusters" / "cluster_3.json").read_text())
    assert cluster3["updates"] == TOTAL and cluster3["rejoined"]["round"] == join
    assert cluster3["samples"] > 0
    accuracy, reference = summary["fused_val_metric"], undisturbed["fused_val_metric"]
    assert abs(accuracy - reference) <= 0.01, (accuracy, reference)
    print(f"\ncluster 3 (providers {list(added)}) joined after round {join} of "
          f"{TOTAL // 2}: {cluster3['rejoined']['bytes']} bytes of state in "
          f"{cluster3['rejoined']['seconds']} s; accuracy {accuracy:.4f} (undisturbed "
          f"{reference:.4f})")

