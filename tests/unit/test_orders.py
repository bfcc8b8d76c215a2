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
from typing import Any

import pytest
import yaml

from ravnest import parse_job
from ravnest.run import draining, growing, jobstatus, local

ROOT = Path(__file__).resolve().parents[2]
PAIRS = 10
"""Orders given at once, by pairs of processes (before the lock, 2 of 10 drain pairs and 6 of 15
grow pairs went wrong)."""
RACER = """
import contextlib, io, json, sys
import ravnest.cli, ravnest.run.draining, ravnest.run.growing, ravnest.spec
args = json.loads(sys.argv[1])
print("ready", flush=True)
for _ in sys.stdin:  # one order per line read
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = ravnest.cli.main(args)
    print(json.dumps({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}),
          flush=True)
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


class Racers:
    """One process per command, each giving its order (`ravnest COMMAND`) once per `race()`,
    all let go together: processes of their own, started once (their imports done)."""

    def __init__(self, *commands: list[str]) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
            str(ROOT / "worker"), os.environ.get("PYTHONPATH")]))}
        self.procs = [subprocess.Popen([sys.executable, "-c", RACER, json.dumps(c)], env=env,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                      for c in commands]
        for p in self.procs:
            assert p.stdout is not None and p.stdout.readline() == "ready\n"

    def race(self) -> list[dict[str, Any]]:
        """Each process's order, given at once: its exit code, stdout and stderr."""
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.flush()
        return [json.loads(p.stdout.readline()) for p in self.procs if p.stdout is not None]

    def __enter__(self) -> Racers:
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
            p.communicate()  # (and closes its pipes)


def test_drains_given_at_once_never_order_every_cluster_away(running: local.LocalRun) -> None:
    """One provider of each of the two clusters drained at once: one order is given, the other
    refused as leaving no cluster to train (as when given one after the other)."""
    assert running.plan is not None
    first, second = (running.plan.node(c.nodes[-1]).provider for c in running.plan.clusters)
    folder = running.out / draining.DRAIN_DIR
    with Racers(*(["drain", "digits", "-o", str(running.out), "--provider", str(p)]
                  for p in (first, second))) as racers:
        for _ in range(PAIRS):
            shutil.rmtree(folder, ignore_errors=True)
            done = racers.race()
            assert sorted(d["code"] for d in done) == [0, 1], done
            (refused,) = [d for d in done if d["code"] == 1]
            assert "would leave no cluster to train" in refused["stderr"], refused
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
    with Racers(*(["grow", str(grown), "-o", str(running.out)] for _ in range(2))) as racers:
        for _ in range(PAIRS):
            shutil.rmtree(folder, ignore_errors=True)
            done = racers.race()
            assert sorted(d["code"] for d in done) == [0, 2], done
            (refused,) = [d for d in done if d["code"] == 2]
            # (checked against the job as the order given first left it: 6 providers and 2 added)
            assert "a running job grows by providers listed after its 8" in refused["stderr"], \
                refused
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


def test_ravnest_drain_refuses_bad_orders_saying_why_and_gives_a_good_one(
        running: local.LocalRun, capsys: pytest.CaptureFixture[str]) -> None:
    """`ravnest drain` on a running job: a provider the job has not, and every provider of the
    job, are refused (exit 1, saying why) with nothing ordered; a provider of one cluster orders
    that cluster's drain, and says so. (The drain itself, at a round boundary of a real run, is
    the operator tier's: tests/integration/test_operator.py.)"""
    from ravnest.cli import main

    assert running.plan is not None
    out, folder = str(running.out), running.out / draining.DRAIN_DIR
    providers = sorted({n.provider for c in running.plan.clusters
                        for n in map(running.plan.node, c.nodes)})
    assert main(["drain", "digits", "-o", out, "--provider", "99"]) == 1
    assert "provider 99 runs no stage of this job" in capsys.readouterr().err
    flags = [a for p in providers for a in ("--provider", str(p))]
    assert main(["drain", "digits", "-o", out, *flags]) == 1
    assert "would leave no cluster to train" in capsys.readouterr().err
    assert not folder.exists() or not list(folder.iterdir())  # nothing was ordered

    provider = running.plan.node(running.plan.clusters[1].nodes[-1]).provider
    assert main(["drain", "digits", "-o", out, "--provider", str(provider)]) == 0
    assert "cluster(s) 1 drain" in capsys.readouterr().out
    assert draining.ordered_clusters(folder) == {1}
