"""Hot spares on `ravnest run` (issue 20, item 5): the 3-cluster digits job of test_elastic with
a tenth provider and `spec.plan.spares: 1`. The planner sets one provider aside; the runner starts
it as a hot spare (its process up, the job's model built, waiting). A node is killed with SIGKILL
mid-run: the spare takes over that node's stage at once, rejoining with the rest of its cluster
from the other clusters' live state, while the other clusters train on; the lost provider becomes
the spare. The run ends with every cluster's weights equal and status.json telling the
takeover. The leaves stop at a gate (gated_loss) from the kill until the spare's cluster has
picked its join round, so that the others cannot finish first, however slowly the spare's cluster
starts: a short job does (it took 150 epochs before the gate)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import torch
from elastic_job import elastic_job, local_run, planned, steps, wait
from gated_loss import SLOW
from processes import pids_with, worker_pid

from ravnest.run.progress import scrape
from ravnest.train.fusing import fuse_stage_files

EPOCHS = 15  # (210 updates: the kill at 40, the join round some rounds after)


def _logged(out: Path) -> dict[str, int]:
    return {p.name: len(p.read_text()) for p in (out / "logs").glob("*.log")}


def _since(out: Path, name: str, logged: dict[str, int]) -> str:
    path = out / "logs" / name
    return path.read_text()[logged.get(name, 0):] if path.exists() else ""


def test_a_hot_spare_takes_over_the_stage_of_a_killed_node(tmp_path: Path, gate: Path) -> None:
    job = elastic_job(tmp_path, EPOCHS, {"everySteps": 0}, spares=1,
                      criterion={"name": "gated_loss:criterion"})
    out = tmp_path / "out"
    # rounds slowed from the start (gated_loss.SLOW): the join round is picked some seconds
    # ahead, and on a fast machine rounds that quick put it past the job's end (it then joins
    # after the final round, and the test saw no rejoin)
    slow = Path(str(gate) + SLOW)
    slow.write_text("0.05")
    with local_run(job, out) as run:
        plan, ports = planned(run, out)
        (spare,) = plan["spares"]
        assert len(plan["nodes"]) == 9 and len(plan["clusters"]) == 3
        spare_log = out / "logs" / f"{spare['name']}.log"
        wait("a hot spare", lambda: spare_log.exists() and "hot spare ready" in
             spare_log.read_text(), run)
        nodes = {n["name"]: n for n in plan["nodes"]}
        # the stem of a cluster that has one (else its leaf): a stage in mid-pipeline
        victim = min(nodes.values(), key=lambda n: (n["role"] != "stem", n["cluster"],
                                                     n["name"]))
        wait("step 40", lambda: len(s := steps(ports)) == len(ports) and min(s.values()) >= 40,
             run)
        pid = worker_pid(out / "nodes" / f"{victim['name']}.json")
        assert pid is not None
        gate.touch()
        logged = _logged(out)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        root = next(n for n in nodes.values() if n["cluster"] == victim["cluster"]
                    and n["stage"] == 0)["name"]
        # the spare's cluster picks its join round with the other clusters' roots, and its
        # workers (the spare for the victim) ask their ring members; then the others go on
        others = [n["name"] for n in nodes.values() if n["stage"] == 0 and n["name"] != root]
        wait("the join round picked", lambda: any(
            f"{root} rejoins ring" in _since(out, f"{n}.log", logged) for n in others), run)
        mine = {n: f"{n}.log" for n in nodes if nodes[n]["cluster"] == victim["cluster"]}
        mine[victim["name"]] = f"{spare['name']}.log"
        wait("its workers asking their ring members", lambda: all(
            "answered within" in (said := _since(out, log, logged)) or "rejoined" in said
            for log in mine.values()), run)
        gate.unlink()

        def rejoined() -> bool:
            try:
                return scrape(ports[root], timeout=0.5).get("ravnest_recoveries_total", 0) >= 1
            except OSError:
                return False
        wait("the cluster rejoined", rejoined, run)
        took = time.monotonic() - killed
        slow.unlink()
        # the victim's stage now runs in the spare's process (started with the run)
        assert pids_with(str(out / "nodes" / f"{spare['name']}.json"), "--spare")
        _, err = run.communicate(timeout=900)
    assert run.returncode == 0, err[-3000:]
    assert f"spare {spare['name']} took over the stage of {victim['name']}" in err

    status = json.loads((out / "status.json").read_text())
    assert status["phase"] == "Succeeded" and status["restarts"] == 0, status
    assert status["recoveries"] == 1
    # (a RavnestJob's status, as the operator writes it: node -> the spare provider it runs on;
    # each spare's phase)
    assert status["takeovers"] == {victim["name"]: spare["provider"]}, status
    # the lost provider is the spare now (started again; stopped with the run)
    assert status["spares"] == {f"spare_{victim['provider']}": "Exited"}, status
    assert f"spare {spare['name']} took over the stage of {victim['name']}" in next(
        c["message"] for c in status["conditions"] if c["type"] == "Recovering")

    logs = {p.stem: p.read_text() for p in (out / "logs").glob("*.log")}
    assert f"spare {spare['name']} (provider {spare['provider']}) took over {victim['name']}" \
        in logs[victim["name"]]
    mine = logs[spare["name"]]
    assert f"{spare['name']} takes over the stage of {victim['name']}" in mine
    join = re.search(r"rejoined after round (\d+) at update (\d+): (\d+) bytes", mine)
    assert join, mine[-2000:]
    assert "hot spare ready" in logs[f"spare_{victim['provider']}"]  # started again, as spare

    summary = json.loads((out / "summary.json").read_text())
    assert summary["clusters"] == 3 and summary["updates"] == EPOCHS * (1437 // (3 * 32))
    copies = [fuse_stage_files(out / "stages", c) for c in range(3)]
    for other in copies[1:]:
        for k, v in copies[0].items():
            torch.testing.assert_close(other[k].float(), v.float(), rtol=0, atol=1e-6, msg=k)
    assert summary["fused_val_metric"] >= 0.95, summary
    assert not pids_with(str(out))  # no worker nor spare left behind
    print(f"\nspare {spare['name']} took over {victim['name']} ({victim['role']}); the cluster "
          f"rejoined {took:.1f} s after the kill at update {join[2]}, {join[3]} bytes; accuracy "
          f"{summary['fused_val_metric']:.4f}")
