"""Orders to a running local job are atomic (issue 40, item 2): `ravnest drain` and `ravnest grow`
given at once, from processes of their own, take turns on the run folder's order lock, each checked
against every order given before it; the runner refuses a file that is no order, saying which, and
trains on. The run is a planned digits job whose folder this test holds as a runner would."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ravnest import parse_job
from ravnest.run import draining, growing, jobstatus, local

ROOT = Path(__file__).resolve().parents[2]
PAIRS = 6
"""Orders given at once, pairs of processes (before the lock, 2 of 10 drain pairs and 6 of 15
grow pairs went wrong)."""
AT_ONCE = """
import sys
import ravnest.cli, ravnest.run.draining, ravnest.run.growing, ravnest.spec
print("ready", flush=True)
sys.stdin.readline()
sys.exit(ravnest.cli.main(sys.argv[1:]))
"""


@pytest.fixture
def running(tmp_path: Path) -> Iterator[local.LocalRun]:
    """A planned digits run whose folder is held (as by its runner, which is this process)."""
    job = parse_job(yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text()))
    run = local.LocalRun(job, tmp_path / "out", progress=False)
    run.prepare()  # (it holds the folder from here, as `ravnest run` does)
    try:
        yield run
    finally:
        run.release()


def _at_once(*commands: list[str]) -> list[subprocess.CompletedProcess[str]]:
    """Run `ravnest COMMAND` for each command in a process of its own, all let go together once
    each has imported what it needs."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(ROOT / "worker"), os.environ.get("PYTHONPATH")]))}
    procs = [subprocess.Popen([sys.executable, "-c", AT_ONCE, *c], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for c in commands]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    done = []
    for p, c in zip(procs, commands, strict=True):
        out, err = p.communicate(timeout=60)
        done.append(subprocess.CompletedProcess(c, p.returncode, out, err))
    return done


def test_drains_given_at_once_never_order_every_cluster_away(running: local.LocalRun) -> None:
    """One provider of each of the two clusters drained at once: one order is given, the other
    refused as leaving no cluster to train (as when given one after the other)."""
    assert running.plan is not None
    first, second = (running.plan.node(c.nodes[-1]).provider for c in running.plan.clusters)
    folder = running.out / draining.DRAIN_DIR
    for _ in range(PAIRS):
        shutil.rmtree(folder, ignore_errors=True)
        done = _at_once(*(["drain", "digits", "-o", str(running.out), "--provider", str(p)]
                          for p in (first, second)))
        assert sorted(d.returncode for d in done) == [0, 1], [(d.stdout, d.stderr) for d in done]
        (refused,) = [d for d in done if d.returncode == 1]
        assert "would leave no cluster to train" in refused.stderr, refused.stderr
        assert len(draining.ordered_clusters(folder)) == 1
        assert not list(folder.glob(".*"))  # (no temporary file left)


def test_grows_given_at_once_are_each_checked_against_the_other(running: local.LocalRun,
                                                               tmp_path: Path) -> None:
    """The same addition ordered twice at once: one order is given, the other refused (the job
    holds those providers already); no order is lost, none is written over, nothing crashes."""
    doc = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())
    doc["spec"]["providers"] += [{"ram": 4, "bandwidth": 1000}, {"ram": 4, "bandwidth": 1000}]
    grown = tmp_path / "grown.yaml"
    grown.write_text(yaml.safe_dump(doc))
    folder = running.out / growing.GROW_DIR
    for _ in range(PAIRS):
        shutil.rmtree(folder, ignore_errors=True)
        done = _at_once(*(["grow", str(grown), "-o", str(running.out)] for _ in range(2)))
        assert sorted(d.returncode for d in done) == [0, 2], [(d.stdout, d.stderr) for d in done]
        (refused,) = [d for d in done if d.returncode == 2]
        # (checked against the job as the order given first left it: 6 providers and 2 added)
        assert "a running job grows by providers listed after its 8" in refused.stderr, \
            refused.stderr
        ((name, order),) = growing.orders(folder, ())
        assert name == "order-0000.json" and isinstance(order, dict)
        assert order["providers"] == [6, 7]
        assert not list(folder.glob(".*"))


def test_the_runner_refuses_a_file_that_is_no_order_and_trains_on(running: local.LocalRun
                                                                  ) -> None:
    """Files in the run's grow/ and drain/ folders that are no orders (no JSON; an order whose
    providers the job it carries does not add; a drain order with no providers) are refused, each
    once, with a condition naming the file; nothing is started or drained, and a drain ordered
    after them is given."""
    assert running.plan is not None
    grow = running.out / growing.GROW_DIR
    grow.mkdir(exist_ok=True)
    (grow / "order-0000.json").write_text("{not json")
    doc = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())
    doc["spec"]["providers"].append({"ram": 4, "bandwidth": 1000})
    (grow / "order-0001.json").write_text(json.dumps({"job": doc, "providers": [99]}))
    drain = running.out / draining.DRAIN_DIR
    drain.mkdir(exist_ok=True)
    (drain / "cluster_1").write_text("garbage")

    assert running._grow() == {}
    said = jobstatus.condition(running.conditions, "Grown")
    assert said is not None and said["status"] == "False" and said["reason"] == "NotApplied"
    assert said["message"].startswith("grow order 2 (order-0001.json) refused: providers: the "
                                      "order adds provider(s) [99], its job adds [6]")
    assert running.grow_seen == {"order-0000.json", "order-0001.json"}
    assert running._grow() == {} and running.grow_orders == 2  # (each refused once)
    assert len(running.job.spec.expanded_providers()) == 6 and len(running.plan.clusters) == 2

    running._note_drained()
    said = jobstatus.condition(running.conditions, "Drained")
    assert said is not None and said["status"] == "False"
    assert said["message"].startswith("drain order cluster_1 refused: JSONDecodeError")
    assert running.drained == {} and not draining.ordered(drain, 1)
    status = json.loads((running.out / "status.json").read_text())
    assert "draining" not in status and status["conditions"][-1]["type"] == "Drained"

    provider = running.plan.node(running.plan.clusters[1].nodes[-1]).provider
    assert draining.order_drain(running.out, [provider], running=True) == [1]
    assert draining.ordered(drain, 1) and draining.refused(drain) == {}
