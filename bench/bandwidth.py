"""The planner's bandwidth awareness, measured: samples/s of the plan made with the providers'
link speeds against the plan made as if every link were the same, on links of those speeds.

Why it exists: the planner's cost model (worker/ravnest/plan/costs.py) charges a stage for the
activations it sends over the slower of its two links, and a ring for the parameters it moves at
its slowest member's bandwidth, so a job's `providers[].bandwidth` changes the plan. Whether that
buys anything is a question for a network whose links really have those speeds.

The network (bench/wan.py's, all made here and removed at the end; needs root, iproute2, tc):
one network namespace per provider, `rvb-h0` .. `rvb-h{n-1}`, each with a veth into one bridge
and address 10.213.0.(i+1); each host's uplink (its veth's egress) limited by tbf to that
provider's rate (`--rates`, Mbit/s; this kernel has no netem, and no delay is added). The
machine's own namespace gets a leg on the bridge (10.213.0.254), unshaped, so the runner reads
the roots' /metrics.

The job is `examples/digits.yaml` with one provider per rate (`--ram` GB each, compute 1) and
`spec.plan` left to the planner (it chooses the clusters). Two jobs are planned from it:
- `aware`: the providers' `bandwidth` is their link's rate;
- `ignoring`: no provider has a `bandwidth`, so the planner takes every link at its default
  (1000 Mbps), as a planner blind to bandwidth would.
Both run as `ravnest run` runs them (`LocalRun`: one worker process per provider, real gRPC,
token checks, Adam), except that each worker runs in its provider's namespace
(`ip netns exec`) and listens on that host's address (`LocalRun.host` / `LocalRun.launch`), on
the same shaped links. Runs alternate between the two; the median of `--repeats` is printed.

For each it prints the plan, the planner's estimate of that plan on the true links
(`planning.estimate` with the true bandwidths), samples/s while training (the roots'
`ravnest_samples_total` over the scrapes that saw it move), samples/s of the whole job
(summary.json: start-up included) and the validation accuracy; then the ratio aware / ignoring.
Then the control, unless `--no-control`: both plans again with every link at the fastest rate,
where bandwidth should not matter (the plan that ignores it may well be the faster one there), so
that what the shaped links show is the links' doing.

    python bench/bandwidth.py [--rates 1000 1000 5] [--epochs 2] [--repeats 2] [--ram 4]
                              [--no-control] [-v]
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import wan
import yaml
from e2e import Scrape, scraping, train_rate

from ravnest import parse_job
from ravnest.plan import building, planning
from ravnest.plan.costs import Workload
from ravnest.plan.plans import Plan, ProviderInfo
from ravnest.run.local import LocalRun
from ravnest.spec import Job

log = logging.getLogger("bench.bandwidth")

ROOT = Path(__file__).resolve().parents[1]
RUNNER_ADDRESS = f"{wan.SUBNET}.254"
"""The runner's own leg on the bridge (unshaped): it scrapes the roots' /metrics from here."""


def _emit(line: str = "") -> None:
    print(line, flush=True)


def jobs(rates: list[float], ram: float, epochs: int) -> dict[str, Job]:
    """The digits job with one provider per rate: with bandwidths (`aware`), without
    (`ignoring`)."""
    doc = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())
    doc["spec"]["training"]["epochs"] = epochs
    doc["spec"]["plan"] = {}
    doc["spec"].pop("checkpoint", None)
    out = {}
    for kind in ("aware", "ignoring"):
        d = copy.deepcopy(doc)
        d["metadata"]["name"] = f"bandwidth-{kind}"
        d["spec"]["providers"] = [{"ram": ram, **({"bandwidth": r} if kind == "aware" else {})}
                                  for r in rates]
        out[kind] = parse_job(d)
    return out


class NetnsRun(LocalRun):
    """`LocalRun` with provider i's workers in network namespace `rvb-h{i}`, at its address."""

    def __init__(self, job: Job, output_dir: str | Path, addresses: list[str]) -> None:
        super().__init__(job, output_dir, progress=False)
        self.addresses = addresses

    def host(self, provider: int) -> str:
        return self.addresses[provider]

    def launch(self, provider: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", f"{wan.PREFIX}-h{provider}", *argv]


def shape(rates: list[float]) -> None:
    """Host i's uplink limited to rates[i] Mbit/s (tbf; its queue holds a second of traffic)."""
    for i, rate_mbit in enumerate(rates):
        rate = rate_mbit * 1e6 / 8
        burst = max(64 << 10, int(rate / 250))
        wan._tc(f"{wan.PREFIX}-h{i}", "qdisc", "replace", "dev", "eth0", "root", "tbf",
                "rate", f"{rate_mbit}mbit", "burst", str(burst), "limit", str(int(rate) + burst))


def runner_leg() -> None:
    """A veth from this namespace into the bridge, so the runner reaches the workers."""
    subprocess.run(["ip", "link", "del", f"{wan.PREFIX}-runner"], capture_output=True)
    wan._ip("link", "add", f"{wan.PREFIX}-runner", "type", "veth", "peer", "name", "pr",
            "netns", f"{wan.PREFIX}-sw")
    wan._ip("link", "set", "pr", "master", "br0", netns=f"{wan.PREFIX}-sw")
    wan._ip("link", "set", "pr", "up", netns=f"{wan.PREFIX}-sw")
    wan._ip("addr", "add", f"{RUNNER_ADDRESS}/24", "dev", f"{wan.PREFIX}-runner")
    wan._ip("link", "set", f"{wan.PREFIX}-runner", "up")


def estimate(plan: Plan, job: Job, rates: list[float]) -> planning.Estimate:
    """The cost model's figures for `plan` on the true links (every provider at its rate)."""
    _, profile, _ = building.plan_job(job)
    pool = [ProviderInfo(p.ram, r, p.compute)
            for p, r in zip(job.spec.expanded_providers(), rates, strict=True)]
    clusters = [[plan.node(n).provider for n in c.nodes] for c in plan.clusters]
    bounds = [[plan.node(n).start for n in c.nodes] + [plan.node(c.nodes[-1]).end]
              for c in plan.clusters]
    return planning.estimate(profile, pool, Workload.from_spec(job.spec), clusters, bounds)


def run_once(job: Job, addresses: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ravnest-bw-") as out:
        run = NetnsRun(job, out, addresses)
        metas = run.prepare()
        scrapes = {m.node: Scrape() for m in metas}
        started = time.time()
        try:
            run.start(metas)
            with scraping(run, scrapes):
                failed = run.wait()
            if failed is not None:
                raise SystemExit(f"{failed.node} failed: see its log\n"
                                 + failed.log.read_text(errors="replace")[-3000:])
        finally:
            run.stop()
        summary = run.finish(time.time() - started)
    assert run.plan is not None
    return {"plan": run.plan, "summary": summary, "train_rate": train_rate(run.plan, scrapes)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[1000, 1000, 5],
                        help="each provider's link, Mbit/s (one provider per rate)")
    parser.add_argument("--ram", type=float, default=4, help="each provider's RAM, GB")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-control", action="store_true",
                        help="skip the control: both plans again with every link at the fastest "
                             "rate")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    if os.geteuid() != 0:
        raise SystemExit("bench/bandwidth.py makes network namespaces: run it as root")
    planned = jobs(args.rates, args.ram, args.epochs)
    links = {"shaped": args.rates}
    if not args.no_control:
        links["equal (control)"] = [max(args.rates)] * len(args.rates)
    _emit(f"Bandwidth-aware plan against a plan ignoring bandwidth: digits, {len(args.rates)} "
          f"providers on links of {', '.join(f'{r:g}' for r in args.rates)} Mbit/s (tbf), "
          f"{args.epochs} epoch(s), median of {args.repeats}; load average "
          f"{os.getloadavg()[0]:.1f}")
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        name: {k: [] for k in planned} for name in links}
    with wan.network(len(args.rates)) as addresses:
        runner_leg()
        for name, rates in links.items():
            shape(rates)
            for rep in range(args.repeats):
                for kind in (planned if rep % 2 == 0 else list(reversed(planned))):
                    r = run_once(planned[kind], addresses)
                    results[name][kind].append(r)
                    log.info("%s links, %s plan, run %d: %.1f samples/s training, %.1f whole "
                             "job", name, kind, rep + 1, r["train_rate"],
                             r["summary"]["samples_per_second"])
    for name, rates in links.items():
        medians = {}
        _emit()
        _emit(f"#### links {name}: {', '.join(f'{r:g}' for r in rates)} Mbit/s")
        for kind, runs in results[name].items():
            plan = runs[-1]["plan"]
            est = estimate(plan, planned["aware"], rates)
            train = [r["train_rate"] for r in runs]
            whole = [r["summary"]["samples_per_second"] for r in runs]
            medians[kind] = statistics.median(train)
            _emit()
            _emit(f"== {kind} plan: planned as {plan.samples_per_second:,.0f} samples/s; on "
                  f"these links the cost model says {est.samples_per_second:,.0f} (ring "
                  f"{est.ring_seconds * 1e3:.1f} ms, slowest cluster "
                  f"{max(est.cluster_seconds) * 1e3:.1f} ms per step)")
            _emit(plan.table())
            _emit(f"samples/s while training (roots): {medians[kind]:.1f}   runs: "
                  + " ".join(f"{v:.1f}" for v in train))
            _emit(f"samples/s, whole job (summary):   {statistics.median(whole):.1f}   runs: "
                  + " ".join(f"{v:.1f}" for v in whole))
            _emit("val accuracy: " + " ".join(f"{r['summary']['val_metric']:.4f}" for r in runs))
        _emit()
        _emit(f"links {name}: aware / ignoring, samples/s while training: "
              f"{medians['aware'] / medians['ignoring']:.2f}x")


if __name__ == "__main__":
    main()
