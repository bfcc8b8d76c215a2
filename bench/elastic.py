"""Steps lost to one failure: elastic recovery (a lost cluster restarted alone, which rejoins
live; and the same with a hot spare, spec.plan.spares: 1, that takes the lost stage over) against
a whole-job restart from the newest checkpoint, on the same job in the same run of this script.

The job is digits in 3 clusters on 9 workers (as tests/integration/test_elastic.py). Each variant
is run `--repeats` times; in each, the same node is killed with SIGKILL once every cluster reached
`--at` updates. Reported per variant (medians):

- *redone*: updates the clusters computed twice, summed over clusters (a whole-job restart
  repeats, in every cluster, the updates since the checkpoint it resumes from; elastic: none);
- *skipped*: updates of the lost cluster's data shard it never trained (elastic: from the update
  it was killed at to the one it rejoined at; whole-job restart: none);
- *stalled*: the longest time the other clusters' step counters stood still before their last
  update (the end of the run, outputs and exits, is not a stall);
- *wall*: the run's wall time, and the fused model's validation accuracy.

    python bench/elastic.py [--epochs 80] [--at 100] [--every 40] [--repeats 1] [--victim root]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
from elastic_job import elastic_job, steps  # tests/integration/elastic_job.py: the test's job
from processes import worker_pid  # tests/integration/processes.py


def one_run(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    recovery = "job" if variant == "job" else "cluster"
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        out = folder / "out"
        cmd = [sys.executable, "-m", "ravnest", "run",
               str(elastic_job(folder, args.epochs, {"everySteps": args.every, "keep": 2},
                               {"backoffLimit": 3, "recovery": recovery},
                               spares=1 if variant == "spare" else 0)), "-o", str(out),
               "--no-progress"]
        started = time.monotonic()
        run = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            while not (out / "plan.txt").exists():
                time.sleep(0.1)
            while variant == "spare" and "hot spare ready" not in "".join(
                    p.read_text() for p in (out / "logs").glob("spare_*.log")):
                time.sleep(0.1)  # the spare is up before the failure, as a hot spare would be
            plan = json.loads(sorted((out / "nodes").glob("node_*.json"))[0].read_text())["plan"]
            nodes = plan["nodes"]
            ports = {n["name"]: json.loads((out / "nodes" / f"{n['name']}.json").read_text())[
                "metricsPort"] for n in nodes}
            victim = next(n for n in nodes if n["role"] == args.victim and n["cluster"] == 1)
            roots = {n["cluster"]: n["name"] for n in nodes if n["role"] == "root"}
            while not ((s := steps(ports)) and len(s) == len(ports)
                       and min(s.values()) >= args.at):
                time.sleep(0.05)
            reached = {c: s[r] for c, r in roots.items()}
            os.kill(worker_pid(out / "nodes" / f"{victim['name']}.json") or 0, signal.SIGKILL)
            others = {r: ports[r] for c, r in roots.items() if c != victim["cluster"]}
            total = args.epochs * (1437 // 96)
            last, still, stalled = steps(others), time.monotonic(), 0.0
            while run.poll() is None:  # until the others trained their last update
                now = steps(others)
                if now and len(now) == len(others) and min(now.values()) >= total:
                    break
                if now and any(now.get(n, -1) > v for n, v in last.items()):
                    last, still = now, time.monotonic()
                elif now:
                    stalled = max(stalled, time.monotonic() - still)
                time.sleep(0.1)
            run.wait()
            err = run.stderr.read() if run.stderr else ""
        finally:
            if run.poll() is None:
                run.kill()
            run.wait()
        wall = time.monotonic() - started
        if run.returncode != 0:
            raise SystemExit(f"{variant}: the run failed:\n{err[-2000:]}")
        summary = json.loads((out / "summary.json").read_text())
        logs = "".join(p.read_text() for p in (out / "logs").glob("*.log"))
    redone = skipped = 0
    restart = re.search(r"resumes from checkpoint at step (\d+)", err)
    if restart:
        redone = sum(v - int(restart[1]) for v in reached.values())
    join = re.search(r"rejoined after round \S+ at update (\d+)", logs)
    took = re.search(r"took over the stage of", err)
    if join:
        skipped = int(join[1]) - reached[victim["cluster"]]
    elif recovery == "cluster":  # the others finished first: the run ended without it
        skipped = summary["updates"] - reached[victim["cluster"]]
    if variant == "spare" and not took:
        raise SystemExit(f"spare: no spare took the stage over:\n{err[-2000:]}")
    return {"redone": redone, "skipped": skipped, "stalled": stalled, "wall": wall,
            "accuracy": summary["fused_val_metric"], "rejoined": bool(join)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--at", type=int, default=100, help="kill once every cluster reached it")
    p.add_argument("--every", type=int, default=40, help="checkpoint interval (updates)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--victim", choices=("root", "stem", "leaf"), default="root")
    args = p.parse_args()
    rows: dict[str, list[dict[str, Any]]] = {"cluster": [], "spare": [], "job": []}
    for _ in range(args.repeats):  # alternate, so that load elsewhere hits all alike
        for variant in rows:
            rows[variant].append(one_run(variant, args))
    print(f"digits, 3 clusters, {args.epochs * (1437 // 96)} updates, {args.victim} of cluster 1 "
          f"killed at update {args.at}, checkpoints every {args.every} ({args.repeats} repeat(s))")
    print(f"{'recovery':<24}{'redone':>8}{'skipped':>9}{'stalled s':>11}{'wall s':>9}"
          f"{'accuracy':>10}")
    for variant, runs in rows.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "rejoined"}
        name = {"cluster": "cluster (elastic)", "spare": "cluster + hot spare",
                "job": "job (whole restart)"}[variant]
        rejoined = sum(r["rejoined"] for r in runs)
        back = "" if variant == "job" else f"  (rejoined in {rejoined} of {len(runs)}" + (
            "; the others finished first in the rest)" if rejoined < len(runs) else ")")
        print(f"{name:<24}{med['redone']:>8.0f}{med['skipped']:>9.0f}{med['stalled']:>11.1f}"
              f"{med['wall']:>9.1f}{med['accuracy']:>10.4f}{back}")


if __name__ == "__main__":
    main()
