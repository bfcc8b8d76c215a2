"""Planner: our plan against a Ravnest-style plan, both scored by the planner's cost model.

Ravnest forms clusters with a genetic algorithm (ravnest/operations/genetic.py): each provider
gets a cluster id in 0..4, and an assignment's penalty is 100 x the RAM (MB) that clusters lack
below the model size, plus the spread between the fastest and slowest cluster "speed", where a
cluster's speed is the sum over its providers of RAM (MB) // bandwidth (Mbps). Population 200,
500 generations, tournaments of 5, one-point crossover, mutation rate 0.01, the best assignment
ever seen wins. Inside each cluster the providers keep their node-id order and the model is cut
into equal parameter shares. This script re-implements that search (same rules and constants,
seeded) and scores the result with `ravnest.plan.planning.estimate`, the same cost model `make_plan`
optimises, next to our own plan. It then times `make_plan` on large pools.

Two conveniences favour the baseline: the model size it must cover is our full training memory
(Ravnest estimates parameters plus activations, less), and the split shares are exactly 1/S (Ravnest
rounds them to tenths, so 4 providers get 0.2/0.2/0.2/0.4).

    python bench/planner.py [--seeds 5] [--generations 500] [--pools 64 1000] [--repeats 3] [-v]

`--resnet` instead plans ResNet-50 (`ravnest.examples.resnet`) on an example input of shape
[100, 3, 224, 224] over 4 providers of 8 GB, in a child process per method so that each peak RSS
(the child's VmHWM) is its own, and prints build, profile and plan seconds and the peak;
`--resnet-reference` adds the reference, the example computed for real at its full batch
(`profile(..., fake=False)`; slower and larger), and checks that both plans are the same.

    python bench/planner.py --resnet [--resnet-reference] [--resnet-providers 4] [--resnet-ram 8]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import torch

from ravnest.errors import PlanError
from ravnest.examples.digits import build_model as digits_model
from ravnest.examples.resnet import build_model as resnet_model
from ravnest.examples.sorter import build_model as sorter_model
from ravnest.plan.costs import Workload
from ravnest.plan.partitioning import Profile, profile
from ravnest.plan.planning import Estimate, estimate, make_plan
from ravnest.plan.plans import GB, Plan, ProviderInfo

log = logging.getLogger("bench.planner")

SORTER_WIDTH = 12
"""The sorter transformer (dim 256, 8 blocks) is profiled for real, then widened this many times
(parameters and FLOPs x width^2, activations x width): about 0.9 B parameters, ~15 GB to train
with AdamW, so that no provider under 16 GB holds it alone."""


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    profile: Profile
    work: Workload


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    providers: int
    draw: Callable[[random.Random], ProviderInfo]


SHAPES = (
    Shape("12 uniform", 12, lambda r: ProviderInfo(r.uniform(2, 32), r.uniform(10, 1000))),
    Shape("12 log-bw", 12,
          lambda r: ProviderInfo(r.uniform(2, 32), 10 ** r.uniform(1, 3))),
    Shape("24 mixed", 24,
          lambda r: ProviderInfo(r.uniform(2, 32), r.uniform(10, 1000), r.uniform(0.5, 2))),
)
"""Pools: RAM 2-32 GB; bandwidth 10-1000 Mbps uniform or log-uniform; compute 1.0 or 0.5-2."""


def widen(prof: Profile, w: int) -> Profile:
    layers = tuple(dataclasses.replace(
        layer, params=layer.params * w * w, param_bytes=layer.param_bytes * w * w,
        buffer_bytes=layer.buffer_bytes * w, flops=layer.flops * w * w,
        out_bytes=layer.out_bytes * w) for layer in prof.layers)
    return dataclasses.replace(prof, layers=layers, cut_bytes=tuple(b * w for b in prof.cut_bytes))


def cases() -> list[Case]:
    torch.manual_seed(0)
    _, digits = profile(digits_model(), [torch.randn(32, 1, 8, 8)])
    _, sorter = profile(sorter_model(dim=256, layers=8), [torch.randint(3, (64, 11))])
    return [
        Case("digits CNN", digits,
             Workload(batch_size=32, microbatches=2, optimizer="Adam", reduce_factor=2)),
        Case(f"sorter x{SORTER_WIDTH}", widen(sorter, SORTER_WIDTH),
             Workload(batch_size=64, microbatches=2, optimizer="AdamW", reduce_factor=4)),
    ]


def pool_of(shape: Shape, seed: int) -> list[ProviderInfo]:
    rng = random.Random(seed)
    return [shape.draw(rng) for _ in range(shape.providers)]


def ravnest_clusters(pool: Sequence[ProviderInfo], need_mb: float, rng: random.Random,
                     generations: int, population: int = 200, max_clusters: int = 5,
                     mutation: float = 0.01) -> list[list[int]]:
    """Ravnest's genetic cluster search; clusters list provider indices in node-id order."""
    ram = [p.ram_gb * 1024 for p in pool]
    speed = [r // (p.bandwidth_mbps or 1000.0) for r, p in zip(ram, pool, strict=True)]
    n = len(pool)

    def penalty(genes: list[int]) -> float:
        rams: dict[int, float] = {}
        speeds: dict[int, float] = {}
        for i, c in enumerate(genes):
            rams[c] = rams.get(c, 0.0) + ram[i]
            speeds[c] = speeds.get(c, 0.0) + speed[i]
        short = sum(need_mb - r for r in rams.values() if r <= need_mb)
        return 100 * short + max(speeds.values()) - min(speeds.values())

    people = [[rng.randrange(max_clusters) for _ in range(n)] for _ in range(population)]
    best, best_penalty = people[0], math.inf
    for _ in range(generations):
        scored = [(genes, penalty(genes)) for genes in people]
        for genes, pen in scored:
            if pen < best_penalty:
                best, best_penalty = genes, pen
        people = []
        for _ in range(population // 2):
            mum, dad = (min(rng.sample(scored, 5), key=lambda s: s[1])[0] for _ in range(2))
            cut = rng.randint(1, n - 1)
            for child in (mum[:cut] + dad[cut:], dad[:cut] + mum[cut:]):
                people.append([rng.randrange(max_clusters) if rng.random() < mutation else g
                               for g in child])
    clusters: dict[int, list[int]] = {}
    for i, c in enumerate(best):
        clusters.setdefault(c, []).append(i)
    return [clusters[c] for c in sorted(clusters)]


def equal_split(prof: Profile, stages: int) -> list[int] | None:
    """Stage bounds with about 1/S of the parameters each, at cuts the model allows."""
    allowed = sorted({0, len(prof.layers)} | {i + 1 for i, ok in enumerate(prof.cut_ok) if ok})
    if stages > len(allowed) - 1:
        return None
    prefix = [0]
    for layer in prof.layers:
        prefix.append(prefix[-1] + layer.params)
    total = prefix[-1]
    bounds, k = [0], 0
    for s in range(1, stages):
        target = s * total / stages
        last = len(allowed) - 1 - (stages - s)
        k = min(range(k + 1, last + 1), key=lambda a: (abs(prefix[allowed[a]] - target), a))
        bounds.append(allowed[k])
    return [*bounds, len(prof.layers)]


def ours(plan: Plan) -> tuple[list[list[int]], list[list[int]]]:
    """A plan's clusters (providers in stage order) and stage bounds, for `estimate`."""
    groups, bounds = [], []
    for c in plan.clusters:
        nodes = plan.cluster_nodes(c.id)
        groups.append([n.provider for n in nodes])
        bounds.append([n.start for n in nodes] + [nodes[-1].end])
    return groups, bounds


def per_batch(e: Estimate, clusters: int) -> float:
    """Seconds per batch of samples: comparable between plans with different cluster counts."""
    return e.step_seconds / clusters


@dataclasses.dataclass(frozen=True)
class Row:
    seed: int
    ours: str
    ours_step: float
    ours_batch: float
    ravnest: str
    ravnest_step: float
    ravnest_batch: float
    resplit_batch: float
    """Ravnest's clusters (node-id order) with our split instead of equal shares."""
    fails: str
    """Why the Ravnest-style plan could not run: stages over RAM, or more stages than cuts."""

    @property
    def ratio(self) -> float:
        return self.ravnest_batch / self.ours_batch


def compare(case: Case, shape: Shape, seed: int, generations: int) -> Row:
    pool = pool_of(shape, seed)
    plan = make_plan(case.profile, pool, case.work)
    groups, bounds = ours(plan)
    mine = estimate(case.profile, pool, case.work, groups, bounds)
    assert mine.fits and math.isclose(mine.samples_per_second, plan.samples_per_second,
                                      rel_tol=1e-6, abs_tol=1e-3), (mine, plan.samples_per_second)
    ga = ravnest_clusters(pool, plan.memory_bytes / 2**20, random.Random(seed), generations)
    splits = [equal_split(case.profile, len(g)) for g in ga]
    if any(s is None for s in splits):
        step = batch = math.inf
        fails = "stages > cuts"
    else:
        theirs = estimate(case.profile, pool, case.work, ga, [s for s in splits if s])
        step, batch = theirs.step_seconds, per_batch(theirs, len(ga))
        fails = f"OOM x{len(theirs.overflows)}" if theirs.overflows else ""
        for line in theirs.overflows:
            log.info("%s, %s, seed %d, Ravnest-style plan: %s", case.name, shape.name, seed, line)
    try:
        resplit = per_batch(estimate(case.profile, pool, case.work, ga), len(ga))
    except PlanError as e:  # a GA cluster that no split fits
        log.info("%s, %s, seed %d, GA clusters with our split: %s", case.name, shape.name, seed, e)
        resplit = math.inf
    return Row(seed, plan.summary(), mine.step_seconds, per_batch(mine, len(groups)),
               f"{len(ga)}x{'/'.join(str(len(g)) for g in ga)}", step, batch, resplit, fails)


def fmt(x: object) -> str:
    if isinstance(x, float):
        return "inf" if math.isinf(x) else f"{x:.4g}"
    return str(x)


def quality(seeds: int, generations: int) -> None:
    head = ("model", "pool", "seed", "ours", "step s", "s/batch", "ravnest", "step s",
            "s/batch", "ratio", "GA+our split", "ravnest fails")
    rows, summary = [], []
    for case in cases():
        alone = make_plan(case.profile, [ProviderInfo(1e6)], case.work)
        print(f"{case.name}: {sum(layer.params for layer in case.profile.layers):,} parameters, "
              f"{alone.memory_bytes / GB:.3g} GB to train, {case.work}")
        for shape in SHAPES:
            results = [compare(case, shape, s, generations) for s in range(seeds)]
            rows += [(case.name, shape.name, r.seed, r.ours, r.ours_step, r.ours_batch, r.ravnest,
                      r.ravnest_step, r.ravnest_batch, r.ratio, r.resplit_batch, r.fails or "-")
                     for r in results]
            running = [r.ratio for r in results if not r.fails]
            summary.append((case.name, shape.name, len(results),
                            statistics.median(r.ours_batch for r in results),
                            statistics.median(r.ravnest_batch for r in results),
                            statistics.median(r.ratio for r in results),
                            statistics.median(running) if running else math.nan,
                            min(r.ratio for r in results),
                            f"{len(results) - len(running)}/{len(results)}"))
    print()
    table(head, rows)
    print()
    table(("model", "pool", "seeds", "ours s/batch", "ravnest s/batch", "median ratio",
           "median where ravnest runs", "min ratio", "ravnest fails"), summary)


def timing(sizes: Sequence[int], repeats: int) -> None:
    rows = []
    shape = SHAPES[0]
    for case in cases():
        for n in sizes:
            draw = random.Random(n)
            pool = [shape.draw(draw) for _ in range(n)]
            wall, cpu, plan = [], [], None
            for _ in range(repeats):
                w0, c0 = time.perf_counter(), time.process_time()
                plan = make_plan(case.profile, pool, case.work)
                wall.append(time.perf_counter() - w0)
                cpu.append(time.process_time() - c0)
            assert plan is not None
            used = len({n.provider for n in plan.nodes})
            rows.append((case.name, n, f"{statistics.median(wall):.3f}",
                         f"{statistics.median(cpu):.3f}", plan.summary() if n <= 64 else
                         f"{len(plan.clusters)} clusters", f"{used}/{n}",
                         f"{plan.samples_per_second:.4g}"))
    table(("model", "providers", "plan wall s", "plan cpu s", "plan", "providers used",
           "est samples/s"), rows)


RESNET_EXAMPLE = (100, 3, 224, 224)
"""ResNet-50's example input: a batch of 100 ImageNet-sized images (60 MB)."""
RESNET_WORK = Workload(batch_size=100, microbatches=4, optimizer="SGD")


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM), in MB (10^6 bytes)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e6
    raise RuntimeError("no VmHWM in /proc/self/status")


def resnet_child(method: str, providers: int, ram_gb: float) -> None:
    """Plan ResNet-50 in this (child) process and print one JSON line of figures.

    `method` "fake" is the planner's own `profile` (fake tensors where the model allows); "run"
    computes the example for real at its full batch (`fake=False`), the reference. The example is
    drawn as `building.example_inputs` draws it."""
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = resnet_model()
    example = torch.rand(RESNET_EXAMPLE, generator=torch.Generator().manual_seed(0))
    t1 = time.perf_counter()
    _, prof = profile(model, [example], fake=method != "run")
    t2 = time.perf_counter()
    plan = make_plan(prof, [ProviderInfo(ram_gb, 100.0)] * providers, RESNET_WORK)
    t3 = time.perf_counter()
    print(json.dumps({
        "method": prof.method, "build_s": t1 - t0, "profile_s": t2 - t1,
        "plan_s": t3 - t2, "total_s": t3 - t0, "peak_rss_mb": peak_rss_mb(),
        "layers": len(prof.layers), "params": sum(layer.params for layer in prof.layers),
        "gflops": sum(layer.flops for layer in prof.layers) / 1e9,
        "summary": plan.summary(), "memory_gb": plan.memory_bytes / GB,
        "samples_per_second": plan.samples_per_second, "fingerprint": plan.fingerprint}))


def resnet(reference: bool, providers: int, ram_gb: float) -> None:
    """Plan ResNet-50 once per method, each in its own child process, and print the figures."""
    print(f"ResNet-50, example {list(RESNET_EXAMPLE)}, {providers} providers of {ram_gb:g} GB, "
          f"{RESNET_WORK}")
    results = {}
    for method in ("fake", "run") if reference else ("fake",):
        w0 = time.perf_counter()
        out = subprocess.run([sys.executable, __file__, "--resnet-child", method,
                              "--resnet-providers", str(providers), "--resnet-ram", str(ram_gb)],
                             check=True, capture_output=True, text=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        row["child_wall_s"] = time.perf_counter() - w0
        results[method] = row
    table(("profiled by", "build s", "profile s", "plan s", "planning s", "child wall s",
           "peak RSS MB", "layers", "GFLOPs", "plan", "train GB", "est samples/s", "fingerprint"),
          [(r["method"], r["build_s"], r["profile_s"], r["plan_s"], r["total_s"],
            r["child_wall_s"], r["peak_rss_mb"], r["layers"], r["gflops"], r["summary"],
            r["memory_gb"], r["samples_per_second"], r["fingerprint"]) for r in results.values()])
    if reference:
        same = results["fake"]["fingerprint"] == results["run"]["fingerprint"]
        print(f"same plan (fingerprint) both ways: {same}")
        if not same:
            sys.exit(1)


def table(head: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [[fmt(v) for v in r] for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) for i, h in enumerate(head)]
    print("  ".join(str(h).rjust(w) for h, w in zip(head, widths, strict=True)))
    for r in cells:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)))
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=5, help="pools per shape (default 5)")
    ap.add_argument("--generations", type=int, default=500,
                    help="generations of the Ravnest-style search (Ravnest: 500)")
    ap.add_argument("--pools", type=int, nargs="*", default=[64, 1000],
                    help="pool sizes to time make_plan on (default 64 1000)")
    ap.add_argument("--repeats", type=int, default=3, help="timings per size; median printed")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--resnet", action="store_true",
                    help="only plan ResNet-50 on [100, 3, 224, 224] in a child process")
    ap.add_argument("--resnet-reference", action="store_true",
                    help="with --resnet: also profile the example for real at its full batch "
                    "(slow and large)")
    ap.add_argument("--resnet-providers", type=int, default=4, help="providers (default 4)")
    ap.add_argument("--resnet-ram", type=float, default=8.0, help="GB each (default 8)")
    ap.add_argument("--resnet-child", choices=("fake", "run"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(message)s", stream=sys.stderr)
    if args.resnet_child:
        resnet_child(args.resnet_child, args.resnet_providers, args.resnet_ram)
        return
    if args.resnet or args.resnet_reference:
        resnet(args.resnet_reference, args.resnet_providers, args.resnet_ram)
        return
    quality(args.seeds, args.generations)
    print()
    timing(args.pools, args.repeats)


if __name__ == "__main__":
    main()
