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

With `--kind KUBECONFIG` the same comparison runs on a kind cluster (scripts/kind-cluster up,
then `load` of the project image), through the operator: the chart is installed, each distinct
rate gets a worker node of its own whose uplink is limited to it with tc tbf (its eth0's egress,
`scripts/kind-cluster shape`), each provider is pinned there (its nodeSelector), and the jobs
are applied as RavnestJobs; the roots' /metrics are read at their pod IPs (a route to each
node's pod CIDR is added here). Two providers on one node talk over that node's own network,
as two machines in one rack would. The whole-job figure is then the roots' samples (their
termination messages) over the time from `kubectl apply` to the job's Succeeded (planner pod,
pod start-up and the operator's reconcile interval included).

    python bench/bandwidth.py [--rates 1000 1000 5] [--epochs 2] [--repeats 2] [--ram 4]
                              [--no-control] [--kind KUBECONFIG [--image I]] [-v]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import wan
import yaml
from e2e import Scrape, _scrape, scraping, train_rate

from ravnest import parse_job
from ravnest.plan import building, planning
from ravnest.plan.costs import Workload
from ravnest.plan.partitioning import Profile
from ravnest.plan.plans import Plan, ProviderInfo
from ravnest.run.local import LocalRun
from ravnest.run.metadata import METRICS_PORT
from ravnest.spec import Job

log = logging.getLogger("bench.bandwidth")

ROOT = Path(__file__).resolve().parents[1]
RUNNER_ADDRESS = f"{wan.SUBNET}.254"
"""The runner's own leg on the bridge (unshaped): it scrapes the roots' /metrics from here."""


def _emit(line: str = "") -> None:
    print(line, flush=True)


def job_docs(rates: list[float], epochs: int,
             provider: Callable[[int], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The digits job with one provider per rate (`provider(i)`: its other fields): with the
    rates as bandwidths (`aware`), without (`ignoring`)."""
    doc = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())
    doc["spec"]["training"]["epochs"] = epochs
    doc["spec"]["plan"] = {}
    doc["spec"].pop("checkpoint", None)
    out = {}
    for kind in ("aware", "ignoring"):
        d = copy.deepcopy(doc)
        d["metadata"]["name"] = f"bandwidth-{kind}"
        d["spec"]["providers"] = [{**provider(i), **({"bandwidth": r} if kind == "aware" else {})}
                                  for i, r in enumerate(rates)]
        out[kind] = d
    return out


def jobs(rates: list[float], ram: float, epochs: int) -> dict[str, Job]:
    return {k: parse_job(d) for k, d in job_docs(rates, epochs, lambda i: {"ram": ram}).items()}


class NetnsRun(LocalRun):
    """`LocalRun` with provider i's workers in network namespace `rvb-h{i}`, at its address."""

    def __init__(self, job: Job, output_dir: str | Path, addresses: list[str]) -> None:
        super().__init__(job, output_dir, progress=False)
        self.addresses = addresses

    def host(self, provider: int) -> str:
        return self.addresses[provider]

    def launch(self, provider: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", f"{wan.PREFIX}-h{provider}", *argv]


def runner_leg() -> None:
    """A veth from this namespace into the bridge, so the runner reaches the workers."""
    subprocess.run(["ip", "link", "del", f"{wan.PREFIX}-runner"], capture_output=True)
    wan._ip("link", "add", f"{wan.PREFIX}-runner", "type", "veth", "peer", "name", "pr",
            "netns", f"{wan.PREFIX}-sw")
    wan._ip("link", "set", "pr", "master", "br0", netns=f"{wan.PREFIX}-sw")
    wan._ip("link", "set", "pr", "up", netns=f"{wan.PREFIX}-sw")
    wan._ip("addr", "add", f"{RUNNER_ADDRESS}/24", "dev", f"{wan.PREFIX}-runner")
    wan._ip("link", "set", f"{wan.PREFIX}-runner", "up")


def estimate(plan: Plan, job: Job, profile: Profile, rates: list[float]) -> planning.Estimate:
    """The cost model's figures for `plan` of `job` (whose model `profile` is) on the true links
    (every provider at its rate)."""
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
                decided = run.wait()
            if not decided.done:
                log = Path(out) / "logs" / f"{decided.down[0].node}.log"
                raise SystemExit(f"{decided.down[0].node} failed: see its log\n"
                                 + log.read_text(errors="replace")[-3000:])
        finally:
            run.stop()
        summary = run.finish(time.time() - started)
    assert run.plan is not None
    return {"plan": run.plan, "summary": summary, "train_rate": train_rate(run.plan, scrapes)}


KIND_NS = "ravnest-bench"
KIND_SYSTEM_NS = "ravnest-bench-system"
KIND_RELEASE = "ravnest-bench"
KIND_PROVIDER = {"ram": "1536Mi", "compute": 0.3}
"""A provider of the kind run: 1.5 GiB and 300m CPU requested (the nodes share this machine's
cores); compute does not change either plan (`ravnest plan` with compute 0.1 to 1)."""


class Kube:
    """kubectl and helm (scripts/k8s-tools' or PATH's) against one cluster."""

    def __init__(self, kubeconfig: str) -> None:
        tools = subprocess.run(["bash", str(ROOT / "scripts" / "k8s-tools"), "--print-bin"],
                               capture_output=True, text=True, check=True).stdout.strip()
        self.env = {**os.environ, "KUBECONFIG": kubeconfig,
                    "PATH": f"{tools}:{os.environ.get('PATH', '')}"}

    def run(self, tool: str, *args: str, stdin: str | None = None, check: bool = True,
            timeout: float = 300) -> str:
        r = subprocess.run([tool, *args], env=self.env, input=stdin, capture_output=True,
                           text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise SystemExit(f"{tool} {' '.join(args)} exited {r.returncode}: {r.stderr[-2000:]}")
        return r.stdout

    def get(self, *args: str) -> dict[str, Any]:
        return dict(json.loads(self.run("kubectl", "get", *args, "-o", "json")))


@contextlib.contextmanager
def kind_cluster(kube: Kube, image: str,
                 rates: list[float]) -> Iterator[tuple[dict[float, str], str]]:
    """The kind cluster made ready for the runs; yields the worker node of each rate.

    Each distinct rate gets a worker node of its own, whose uplink (its eth0's egress) is limited
    to it (scripts/kind-cluster shape); the providers of that rate run there (nodeSelector), so
    two of them talk over that node's own network and the others over the nodes' links. This
    machine gets a route to each node's pod CIDR, to read the roots' /metrics. The chart is
    installed with `image` (the jobs' too). All of it is undone at the end."""
    nodes = kube.get("nodes")["items"]
    workers = sorted(n["metadata"]["name"] for n in nodes
                     if not any(t.get("effect") == "NoSchedule"
                                for t in n["spec"].get("taints") or []))
    distinct = sorted(set(rates), reverse=True)
    if len(distinct) > len(workers):
        raise SystemExit(f"--rates has {len(distinct)} different rates and the cluster "
                         f"{len(workers)} schedulable node(s): one node per rate is needed")
    node_of = {r: workers[i] for i, r in enumerate(distinct)}
    cluster = subprocess.run(["docker", "inspect", "-f",
                              '{{index .Config.Labels "io.x-k8s.kind.cluster"}}', workers[0]],
                             capture_output=True, text=True, check=True).stdout.strip()
    routes = [(n["spec"]["podCIDR"], next(a["address"] for a in n["status"]["addresses"]
                                         if a["type"] == "InternalIP"))
              for n in nodes if n["spec"].get("podCIDR")]
    repo, _, tag = image.rpartition(":")
    try:
        for rate, node in node_of.items():
            kind_shape(cluster, node, rate)
        for cidr, via in routes:
            wan._ip("route", "replace", cidr, "via", via)
        kube.run("helm", "upgrade", "--install", KIND_RELEASE, str(ROOT / "charts" / "ravnest"),
                 "-n", KIND_SYSTEM_NS, "--create-namespace", "--set", f"image.repository={repo}",
                 "--set", f"image.tag={tag}", "--set", "image.pullPolicy=IfNotPresent",
                 "--wait", "--timeout", "5m", timeout=400)
        kube.run("kubectl", "create", "namespace", KIND_NS, check=False)
        yield node_of, cluster
    finally:
        kube.run("kubectl", "delete", "rj", "--all", "-n", KIND_NS, "--ignore-not-found",
                 "--wait=true", check=False)
        kube.run("helm", "uninstall", KIND_RELEASE, "-n", KIND_SYSTEM_NS, "--wait", check=False)
        kube.run("kubectl", "delete", "namespace", KIND_NS, KIND_SYSTEM_NS, "--ignore-not-found",
                 "--wait=true", check=False)
        for cidr, via in routes:
            subprocess.run(["ip", "route", "del", cidr, "via", via], capture_output=True)
        for node in node_of.values():
            kind_shape(cluster, node, None)


def kind_shape(cluster: str, node: str, rate: float | None) -> None:
    """`node`'s uplink limited to `rate` Mbit/s (None: not limited)."""
    subprocess.run(["bash", str(ROOT / "scripts" / "kind-cluster"), "shape", node,
                    "off" if rate is None else f"{rate:g}"],
                   env={**os.environ, "KIND_CLUSTER": cluster}, check=rate is not None)


def run_kind_once(kube: Kube, doc: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """Apply the job, scrape its roots (at their pod IPs) until it succeeded, delete it."""
    name = doc["metadata"]["name"]
    applied = time.monotonic()
    kube.run("kubectl", "apply", "-f", "-", stdin=yaml.safe_dump(doc))
    scrapes = {n.name: Scrape() for n in plan.nodes}
    roots: dict[str, str] = {}
    """Each cluster root's node name -> its pod's IP."""
    deadline, polled, st = time.monotonic() + 1200, 0.0, {}
    try:
        while True:
            if time.monotonic() - polled > 2:
                polled = time.monotonic()
                st = kube.get("rj", name, "-n", KIND_NS).get("status") or {}
                if st.get("phase") in ("Succeeded", "Failed"):
                    break
                if len(roots) < len(plan.clusters):
                    pods = kube.get("pods", "-n", KIND_NS, "-l",
                                    f"ravnest.io/job={name},ravnest.io/stage=0")["items"]
                    roots = {p["metadata"]["labels"]["ravnest.io/node"].replace("-", "_"):
                             p["status"]["podIP"] for p in pods if p["status"].get("podIP")}
            for node, ip in roots.items():
                try:
                    _scrape(METRICS_PORT, scrapes[node], host=ip)
                except (OSError, ValueError):
                    pass  # not serving yet, or gone
            if time.monotonic() > deadline:
                raise SystemExit(f"{name}: not done after 20 minutes: {st}")
            time.sleep(0.25)
        done = time.monotonic()
        if st.get("phase") == "Failed":
            raise SystemExit(f"{name} failed: {st.get('conditions')}")
        said = [json.loads(cs["state"]["terminated"]["message"])
                for p in kube.get("pods", "-n", KIND_NS, "-l",
                                  f"ravnest.io/job={name},ravnest.io/stage=0")["items"]
                for cs in p["status"].get("containerStatuses") or []
                if (cs.get("state") or {}).get("terminated", {}).get("message")]
    finally:
        kube.run("kubectl", "delete", "rj", name, "-n", KIND_NS, "--wait=true", check=False)
    planned = (st.get("plan") or {}).get("fingerprint")
    if planned != plan.fingerprint:
        raise SystemExit(f"{name}: the operator planned {planned}, this bench {plan.fingerprint}")
    result = st.get("result") or {}
    samples = sum(s.get("samples", 0) for s in said)
    return {"plan": plan, "train_rate": train_rate(plan, scrapes),
            "summary": {"samples_per_second": samples / (done - applied),
                        "val_metric": result.get("val_metric", float("nan"))}}


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
    parser.add_argument("--kind", metavar="KUBECONFIG",
                        help="run the jobs on this kind cluster (scripts/kind-cluster's) through "
                             "the operator, a node per rate, instead of in namespaces")
    parser.add_argument("--image", default="ravnest-k8s:test",
                        help="with --kind: the project image, loaded on the nodes already")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    if os.geteuid() != 0:
        raise SystemExit("bench/bandwidth.py makes network namespaces and routes: run it as root")
    links = {"shaped": args.rates}
    if not args.no_control:
        links["equal (control)"] = [max(args.rates)] * len(args.rates)
    where = ("kind nodes (tbf on each node's uplink), through the operator" if args.kind
             else "network namespaces (tbf on each host's uplink), as `ravnest run`")
    _emit(f"Bandwidth-aware plan against a plan ignoring bandwidth: digits, {len(args.rates)} "
          f"providers on links of {', '.join(f'{r:g}' for r in args.rates)} Mbit/s, on "
          f"{where}; {args.epochs} epoch(s), median of {args.repeats}; load average "
          f"{os.getloadavg()[0]:.1f}")
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        name: {k: [] for k in ("aware", "ignoring")} for name in links}

    def alternate(name: str, run: Callable[[str, int], dict[str, Any]]) -> None:
        for rep in range(args.repeats):
            for kind in (("aware", "ignoring") if rep % 2 == 0 else ("ignoring", "aware")):
                r = run(kind, rep)
                results[name][kind].append(r)
                log.info("%s links, %s plan, run %d: %.1f samples/s training, %.1f whole job",
                         name, kind, rep + 1, r["train_rate"],
                         r["summary"]["samples_per_second"] or math.nan)

    if args.kind:
        kube = Kube(args.kind)
        with kind_cluster(kube, args.image, args.rates) as (node_of, cluster):
            docs = job_docs(args.rates, args.epochs, lambda i: {
                **KIND_PROVIDER, "nodeSelector": {"kubernetes.io/hostname":
                                                  node_of[args.rates[i]]}})
            planned = {k: parse_job(d) for k, d in docs.items()}
            plans = {k: building.preflight(j)[0] for k, j in planned.items()}
            for name, rates in links.items():
                for rate, node in node_of.items():
                    kind_shape(cluster, node, rates[args.rates.index(rate)])

                def on_kind(kind: str, rep: int) -> dict[str, Any]:
                    doc = copy.deepcopy(docs[kind])
                    doc["metadata"] = {"name": f"{doc['metadata']['name']}-{rep}",
                                       "namespace": KIND_NS}
                    return run_kind_once(kube, doc, plans[kind])

                alternate(name, on_kind)
    else:
        planned = jobs(args.rates, args.ram, args.epochs)
        with wan.network(len(args.rates)) as addresses:
            runner_leg()
            for name, rates in links.items():
                wan.shape_links(rates)
                alternate(name, lambda kind, rep: run_once(planned[kind], addresses))
    report(links, results, planned["aware"])


def report(links: dict[str, list[float]], results: dict[str, dict[str, list[dict[str, Any]]]],
           aware: Job) -> None:
    _, profile, _ = building.plan_job(aware)
    for name, rates in links.items():
        medians = {}
        _emit()
        _emit(f"#### links {name}: {', '.join(f'{r:g}' for r in rates)} Mbit/s")
        for kind, runs in results[name].items():
            plan = runs[-1]["plan"]
            est = estimate(plan, aware, profile, rates)
            train = [r["train_rate"] for r in runs]
            whole = [r["summary"]["samples_per_second"] or math.nan for r in runs]
            medians[kind] = statistics.median(train)
            _emit()
            _emit(f"== {kind} plan: planned as {plan.samples_per_second:,.0f} samples/s; on "
                  f"these links the cost model says {est.samples_per_second:,.0f} (ring "
                  f"{est.ring_seconds * 1e3:.1f} ms, slowest cluster "
                  f"{max(est.cluster_seconds) * 1e3:.1f} ms per step)")
            _emit(plan.table())
            _emit(f"samples/s while training (roots): {medians[kind]:.1f}   runs: "
                  + " ".join(f"{v:.1f}" for v in train))
            _emit(f"samples/s, whole job:             {statistics.median(whole):.1f}   runs: "
                  + " ".join(f"{v:.1f}" for v in whole))
            _emit("val accuracy: " + " ".join(f"{r['summary']['val_metric']:.4f}" for r in runs))
        _emit()
        _emit(f"links {name}: aware / ignoring, samples/s while training: "
              f"{medians['aware'] / medians['ignoring']:.2f}x")


if __name__ == "__main__":
    main()
