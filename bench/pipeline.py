"""Pipeline throughput: our runtime against the bound that its schedule allows.

Why it exists: a pipeline of S stages over m microbatches is idle part of the time (the bubble).
With a known cost per stage the best a schedule can do is known too, so the runtime's own
overhead and scheduling losses show as the ratio of measured to bound:

- `sync` (a flush per optimizer step): an update takes at least
  sum_i (f_i + b_i) + (m - 1) * max_i (f_i + b_i), i.e. (m + S - 1) * c with equal stages of cost
  c = f + b per microbatch, so throughput <= m / (m + S - 1) of the slowest-stage bound 1 / c;
- `async` (no flush between updates): throughput <= 1 / max_i (f_i + b_i) microbatches per second.

Three spawned processes each run one stage through the real worker path: a `NodeRuntime` with its
`Server`, `Inbox` and `Peer`s on 127.0.0.1 (real gRPC, token and fingerprint checks, Adam). Each
stage is a small Linear followed by a block that *sleeps* a fixed time in forward and in backward:
sleeping, not burning CPU, so that three stages on a 2-core machine can run at once the way they
would on three machines; what is left on the CPU is our runtime's own work (framing, gRPC,
autograd, the optimizer), which is exactly what the ratio is meant to expose.

A run feeds `warmup + updates` batches; the root's optimizer steps are timed, and throughput is
microbatches over the steady window after the warmup updates. Every configuration is repeated,
repeats alternate between configurations, and the median is printed.

The baseline, in the same run: torch.distributed.pipelining's ScheduleGPipe and Schedule1F1B over
gloo on 127.0.0.1, one process per stage, running the same stage modules (same trace, cut, seed
and sleeps), the same Adam, batches, microbatches per update, warmup and updates, timed the same
way at stage 0. Both flush every update (torch has no asynchronous schedule), so they are the
same work as `sync`; beside `async` they say what not flushing buys. The baseline and ours
alternate repeat by repeat; `--no-torch` skips it.

    python bench/pipeline.py [--micro 1 2 4 8] [--repeats 3] [--cost-ms 10 20] [--no-torch] [-v]
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import queue
import resource
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch
from torch import fx, nn

log = logging.getLogger("bench.pipeline")

CREDS_TOKEN = "bench-token"
FINGERPRINT = "bench-pipeline"
SEED = 11


def _emit(line: str = "") -> None:
    print(line, flush=True)


# ----------------------------------------------------------------------------- the model


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fwd: float, bwd: float) -> torch.Tensor:
        ctx.bwd = bwd
        if fwd > 0:
            time.sleep(fwd)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.bwd > 0:
            time.sleep(ctx.bwd)
        return grad, None, None


def sleep_block(x: torch.Tensor, fwd: float, bwd: float) -> torch.Tensor:
    """Identity that takes `fwd` seconds forward and `bwd` seconds backward."""
    out: torch.Tensor = _Sleep.apply(x, fwd, bwd)
    return out


fx.wrap("sleep_block")


@dataclass(frozen=True)
class StageCost:
    fwd: float
    """Seconds slept per microbatch forward."""
    bwd: float
    """Seconds slept per microbatch backward."""
    layers: int = 1
    """Linear+ReLU layers before the sleep."""
    width: int = 64


class StagedNet(nn.Module):
    """Per stage: `layers` x (Linear, ReLU), then a sleep block; stages cut after each sleep."""

    def __init__(self, costs: tuple[StageCost, ...]) -> None:
        super().__init__()
        self.costs = costs
        self.fcs = nn.ModuleList(
            nn.ModuleList(nn.Linear(c.width, c.width) for _ in range(c.layers)) for c in costs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for fcs, c in zip(self.fcs.children(), self.costs, strict=True):
            for fc in fcs.children():
                x = torch.relu(fc(x))
            x = sleep_block(x, c.fwd, c.bwd)
        return x


# ----------------------------------------------------------------------------- one run


@dataclass(frozen=True)
class RunConfig:
    name: str
    schedule: str
    microbatches: int
    updates: int
    """Updates timed after the warmup."""
    warmup: int
    costs: tuple[StageCost, ...]
    mb_rows: int = 8
    max_in_flight: int = 4
    sample_memory: bool = False
    """Sample this process's RSS every few ms during the run (bench/memory.py)."""

    @property
    def stages(self) -> int:
        return len(self.costs)

    def bound(self) -> float:
        """Best microbatches/s the schedule allows with these stage costs."""
        c = [s.fwd + s.bwd for s in self.costs]
        if self.schedule == "async":
            return 1.0 / max(c)
        return self.microbatches / (sum(c) + (self.microbatches - 1) * max(c))


@dataclass
class NodeReport:
    """What one node process reports about one run."""

    node: str
    step_times: list[float] = field(default_factory=list)
    rss_base: int = 0
    anon_base: int = 0
    peak_rss: int = 0
    """Peak RSS of the process over its life (ru_maxrss)."""
    rss_samples: list[tuple[float, int, int]] = field(default_factory=list)
    """(seconds, RSS, anonymous RSS) every 5 ms of the run, when sampled."""
    max_pending: int = 0
    max_stashes: int = 0
    """Most weight stashes (async versions) alive at once."""
    data_bytes: int = 0
    max_inbox: int = 0
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    stash_bytes: int = 0
    activation_bytes_per_mb: int = 0
    updates: int = 0
    activity: dict[str, float] = field(default_factory=dict)
    """ravnest_training_seconds_total by activity, from the node's own metrics."""


def _rss() -> tuple[int, int]:
    """(RSS, anonymous RSS): resident pages, and those not backed by files (libraries)."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    return int(fields[1]) * _PAGE, (int(fields[1]) - int(fields[2])) * _PAGE


_PAGE = 4096


def _plan(profile: Any, costs: tuple[StageCost, ...]) -> Any:
    """A one-cluster plan cutting after every sleep block (the planner does not know sleeps)."""
    from ravnest.plan.plans import ClusterPlan, NodePlan, Plan

    cuts = [i + 1 for i, layer in enumerate(profile.layers) if "sleep_block" in layer.name]
    assert len(cuts) == len(costs), cuts
    nodes, start = [], 0
    for st, end in enumerate(cuts):
        layers = profile.layers[start:end]
        role = "root" if st == 0 else "leaf" if st == len(costs) - 1 else "stem"
        nodes.append(NodePlan(
            name=f"node_{st}", provider=st, cluster=0, stage=st, role=role, start=start, end=end,
            first_layer=layers[0].name, last_layer=layers[-1].name,
            state=tuple(s for layer in layers for s in layer.state),
            params=sum(layer.params for layer in layers), memory_bytes=0, ram_gb=1.0,
            seconds_per_microbatch=costs[st].fwd + costs[st].bwd))
        start = end
    return Plan(clusters=(ClusterPlan(0, tuple(n.name for n in nodes), 0.0),), nodes=tuple(nodes),
                rings=(), model_bytes=0, memory_bytes=0, samples_per_second=0.0,
                fingerprint=FINGERPRINT)


def _tensor_bytes(ts: Any) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


def _run_once(cfg: RunConfig, node: str, inbox: Any, peers: dict[str, Any]) -> NodeReport:
    """Build this node's stage for `cfg` and train through it; report timings and memory."""
    import threading

    from ravnest.plan.partitioning import build_stage, profile
    from ravnest.train.metrics import ACTIVITIES, Identity, WorkerMetrics
    from ravnest.train.runtime import Batches, NodeRuntime
    from ravnest.train.settings import Settings

    rss, anon = _rss()
    report = NodeReport(node=node, rss_base=rss, anon_base=anon)
    stop = threading.Event()

    def sample() -> None:
        t0 = time.perf_counter()
        while not stop.wait(0.005):
            report.rss_samples.append((time.perf_counter() - t0, *_rss()))
            pending = list(rt.pending.values())
            report.max_pending = max(report.max_pending, len(pending))
            stashes = {id(p.stash) for p in pending if p.stash is not None}
            if rt._stash is not None:
                stashes.add(id(rt._stash))
            report.max_stashes = max(report.max_stashes, len(stashes))
            report.max_inbox = max(report.max_inbox, rt.inbox.pipeline.qsize())

    torch.manual_seed(SEED)
    model = StagedNet(cfg.costs)
    width = cfg.costs[0].width
    gm, prof = profile(model, (torch.zeros(cfg.mb_rows, width),))
    plan = _plan(prof, cfg.costs)
    me = plan.node(node)
    stage = build_stage(gm, me.start, me.end)
    del model, gm
    params = [p for p in stage.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=1e-3) if params else None
    criterion = nn.functional.cross_entropy if me.is_leaf else None
    bsz = cfg.microbatches * cfg.mb_rows
    batches = None
    if me.is_root:
        n_batches = cfg.warmup + cfg.updates
        gen = torch.Generator().manual_seed(SEED)
        xs = torch.randn(n_batches, bsz, width, generator=gen)
        ys = torch.randint(0, width, (n_batches, bsz), generator=gen)

        def train(epoch: int) -> Iterator[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
            for i in range(n_batches):
                yield (xs[i],), ys[i]

        def validation() -> Iterator[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
            yield (xs[0][: cfg.mb_rows],), ys[0][: cfg.mb_rows]

        batches = Batches(train=train, per_epoch=n_batches, validation=validation)
        report.data_bytes = _tensor_bytes((xs, ys))
    settings = Settings(epochs=1, batch_size=bsz, microbatches=cfg.microbatches,
                        schedule=cfg.schedule, max_in_flight=cfg.max_in_flight,
                        peer_timeout=120.0)
    who = Identity("bench", "default", node, me.role, 0, me.stage)
    metrics, metrics_labels = WorkerMetrics(who), who.labels()

    class Timed(NodeRuntime):
        def _optimizer_step(self) -> None:
            super()._optimizer_step()
            report.step_times.append(time.perf_counter())

    rt = Timed(node, plan, stage, settings, optimizer, None, criterion, inbox, peers, metrics,
               batches)
    sampler = threading.Thread(target=sample, daemon=True) if cfg.sample_memory else None
    if sampler is not None:
        sampler.start()
    try:
        if me.is_root:
            rt.drive()
        else:
            rt.serve()
    finally:
        stop.set()
        if sampler is not None:
            sampler.join()
    report.updates = rt.updates
    report.peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report.activity = {a: metrics.registry.get_sample_value(
        "ravnest_training_seconds_total", {**metrics_labels, "activity": a}) or 0.0
        for a in ACTIVITIES}
    report.param_bytes = _tensor_bytes(stage.parameters())
    # one set of gradients (zeroed to None after each step); async adds the stash's gradients,
    # which live until they are added into the live ones
    report.grad_bytes = report.param_bytes * (2 if cfg.schedule == "async" else 1)
    if optimizer is not None:
        report.optimizer_bytes = _tensor_bytes(
            v for s in optimizer.state.values() for v in s.values())
    if cfg.schedule == "async":
        report.stash_bytes = report.param_bytes * max(1, report.max_stashes)
    scale = cfg.mb_rows / prof.example_batch
    report.activation_bytes_per_mb = int(scale * (
        sum(layer.out_bytes for layer in prof.layers[me.start:me.end])
        + (prof.cut_bytes[me.start - 1] if me.start else 0)))
    return report


def node_main(node: str, addresses: dict[str, str], runs: list[RunConfig], results: Any,
              verbose: bool) -> None:
    """One node process: serve gRPC, then take part in every run in order."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format=f"%(asctime)s {node} %(levelname)s %(message)s")
    torch.set_num_threads(1)
    from ravnest.comm.inboxes import Inbox
    from ravnest.comm.transport import Credentials, Peer, Server
    from ravnest.train import heap

    heap.tune(os.environ)  # as a worker does

    creds = Credentials(CREDS_TOKEN, FINGERPRINT)
    names = sorted(addresses)
    i = names.index(node)
    neighbours = [n for n in (names[i - 1] if i else None,
                              names[i + 1] if i + 1 < len(names) else None) if n]
    inbox = Inbox(capacity=4 * max(r.max_in_flight for r in runs) + 64)
    server = Server(addresses[node], creds, inbox.deliver)
    server.start()
    peers = {n: Peer(addresses[n], creds) for n in neighbours}
    try:
        for p in peers.values():
            p.wait_ready(120)
        for k, cfg in enumerate(runs):
            report = _run_once(cfg, node, inbox, peers)
            results.put((k, report))
    except BaseException as e:
        results.put((-1, f"{node}: {type(e).__name__}: {e}"))
        raise
    finally:
        for p in peers.values():
            p.close()
        server.stop()


def _collect(procs: list[Any], results: Any, expected: int, timeout: float, what: str,
             on_result: Any) -> None:
    """Take `expected` (k, report) results from the processes' queue and always end the
    processes: a process that reports an error (k < 0) or dies without one, or results that do
    not all come within `timeout` seconds, raise RuntimeError."""
    deadline = time.monotonic() + timeout
    got = 0
    try:
        while got < expected:
            try:
                k, rep = results.get(timeout=1.0)
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"{what}: a process exited with code {dead[0]} after "
                                       f"{got} of {expected} results") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{what}: {got} of {expected} results after "
                                       f"{timeout:.0f} s") from None
                continue
            if k < 0:
                raise RuntimeError(f"{what}: {rep}")
            on_result(k, rep)
            got += 1
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


def run_nodes(runs: list[RunConfig], stages: int, verbose: bool = False,
              timeout: float = 600) -> list[dict[str, NodeReport]]:
    """Spawn one process per stage, run `runs` in order; one {node: report} per run."""
    from ravnest.run.local import free_ports

    names = [f"node_{i}" for i in range(stages)]
    ports = free_ports(stages)
    addresses = {n: f"127.0.0.1:{p}" for n, p in zip(names, ports, strict=True)}
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=node_main, args=(n, addresses, runs, results, verbose),
                         daemon=True) for n in names]
    for p in procs:
        p.start()
    out: list[dict[str, NodeReport]] = [{} for _ in runs]

    def take(k: int, rep: NodeReport) -> None:
        out[k][rep.node] = rep
        if verbose and rep.node == names[0]:
            log.info("%s done", runs[k].name)

    _collect(procs, results, len(runs) * stages, timeout, "our pipeline", take)
    return out


def throughput(cfg: RunConfig, root: NodeReport) -> float:
    """Microbatches per second over the steady window (after the warmup updates)."""
    t = root.step_times
    if len(t) < cfg.warmup + 2:
        raise RuntimeError(f"{cfg.name}: root made {len(t)} steps, expected "
                           f"{cfg.warmup + cfg.updates}")
    window = t[cfg.warmup:]
    return (len(window) - 1) * cfg.microbatches / (window[-1] - window[0])


# ----------------------------------------------------------------------------- the baseline

TORCH_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B"}
"""torch.distributed.pipelining schedules timed as the baseline, by RunConfig.schedule."""


class BaselineError(RuntimeError):
    """The torch.distributed.pipelining baseline could not run: gloo did not start, a rank
    failed, or the runs did not finish in time."""


def torch_runs(ours: list[RunConfig]) -> dict[str, dict[str, RunConfig]]:
    """For each of our configurations (by name), the baseline's runs of the same work: the same
    stages, microbatches per update, updates and warmup, one per torch schedule. Ours that differ
    only in schedule or maxInFlight share runs; 1F1B needs at least one microbatch per stage."""
    shared: dict[tuple[Any, ...], dict[str, RunConfig]] = {}
    out = {}
    for c in ours:
        key = (c.costs, c.microbatches, c.updates, c.warmup, c.mb_rows)
        if key not in shared:
            shared[key] = {s: replace(c, name=f"{s} as {c.name}", schedule=s)
                           for s in TORCH_SCHEDULES if s != "1f1b" or c.microbatches >= c.stages}
        out[c.name] = shared[key]
    return out


def _loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    """The leaf's criterion; a stage's module returns its output in a tuple of one."""
    loss: torch.Tensor = nn.functional.cross_entropy(
        out[0] if isinstance(out, tuple) else out, target)
    return loss


def _torch_once(cfg: RunConfig, rank: int) -> NodeReport:
    """Train `cfg`'s batches through this rank's stage with a torch schedule; time its updates.

    The stage is the module our runtime runs (the same trace, cut and seed), the optimizer the
    same Adam, the batches the same tensors, split by the schedule into `cfg.microbatches`."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from ravnest.plan.partitioning import build_stage, profile

    torch.manual_seed(SEED)
    model = StagedNet(cfg.costs)
    width = cfg.costs[0].width
    gm, prof = profile(model, (torch.zeros(cfg.mb_rows, width),))
    me = _plan(prof, cfg.costs).nodes[rank]
    module = build_stage(gm, me.start, me.end).graph_module
    del model, gm
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=1e-3) if params else None
    stage = PipelineStage(module, rank, cfg.stages, torch.device("cpu"))
    schedule_cls = ScheduleGPipe if cfg.schedule == "gpipe" else Schedule1F1B
    schedule = schedule_cls(stage, cfg.microbatches, loss_fn=_loss)
    n_batches = cfg.warmup + cfg.updates
    bsz = cfg.microbatches * cfg.mb_rows
    gen = torch.Generator().manual_seed(SEED)
    xs = torch.randn(n_batches, bsz, width, generator=gen)
    ys = torch.randint(0, width, (n_batches, bsz), generator=gen)
    report = NodeReport(node=f"rank_{rank}")
    for x, y in zip(xs, ys, strict=True):
        if me.is_root:
            schedule.step(x)
        elif me.is_leaf:
            schedule.step(target=y)
        else:
            schedule.step()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        report.step_times.append(time.perf_counter())
    report.updates = n_batches
    return report


def torch_main(rank: int, world: int, port: int, runs: list[RunConfig], results: Any,
               verbose: bool) -> None:
    """One gloo rank: join the process group, then run every baseline run in order."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format=f"%(asctime)s rank_{rank} %(levelname)s %(message)s")
    torch.set_num_threads(1)
    import torch.distributed as dist

    store = f"tcp://127.0.0.1:{port}"
    try:
        try:
            dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=120))
        except Exception as e:
            raise BaselineError(
                f"gloo did not start ({store}, GLOO_SOCKET_IFNAME="
                f"{os.environ.get('GLOO_SOCKET_IFNAME')}): {type(e).__name__}: {e}") from e
        for k, cfg in enumerate(runs):
            dist.barrier()
            results.put((k, _torch_once(cfg, rank)))
    except BaselineError as e:
        results.put((-1, f"rank {rank}: {e}"))
        raise SystemExit(1) from None
    except BaseException as e:
        results.put((-1, f"rank {rank}: {type(e).__name__}: {e}"))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_torch(runs: list[RunConfig], stages: int, verbose: bool = False) -> list[NodeReport]:
    """Spawn one gloo rank per stage, run `runs` in order; rank 0's report per run.

    Bounded: every process ends when the runs are done or fail, or after two minutes to start
    plus four times the runs' bounds."""
    from ravnest.run.local import free_ports

    port = free_ports(1)[0]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=torch_main, args=(r, stages, port, runs, results, verbose),
                         daemon=True) for r in range(stages)]
    for p in procs:
        p.start()
    out: list[NodeReport] = [NodeReport(node="rank_0") for _ in runs]

    def take(k: int, rep: NodeReport) -> None:
        if rep.node == "rank_0":
            out[k] = rep

    timeout = 120 + 4 * sum((c.warmup + c.updates) * c.microbatches / c.bound() for c in runs)
    try:
        _collect(procs, results, len(runs) * stages, timeout,
                 "the torch.distributed.pipelining baseline failed", take)
    except RuntimeError as e:
        raise BaselineError(str(e)) from e
    return out


# ----------------------------------------------------------------------------- main


def _sleep_overshoot() -> float:
    late = []
    for _ in range(50):
        t = time.perf_counter()
        time.sleep(0.01)
        late.append(time.perf_counter() - t - 0.01)
    return statistics.median(late)


def configs(micro: list[int], fwd: float, bwd: float, mb_total: int, in_flight: int,
            more_in_flight: list[int]) -> list[RunConfig]:
    equal = tuple(StageCost(fwd, bwd) for _ in range(3))
    skewed = (StageCost(fwd, bwd), StageCost(2 * fwd, 2 * bwd), StageCost(fwd, bwd))
    out = []
    for m in micro:
        out.append(RunConfig(f"sync m={m}", "sync", m, max(8, mb_total // m), 2, equal,
                             max_in_flight=in_flight))
    for m in (1, 4):
        out.append(RunConfig(f"async m={m}", "async", m, max(6, mb_total // m), 2, equal,
                             max_in_flight=in_flight))
    # the async bound needs the pipeline kept full: enough microbatches in flight to cover a
    # round trip through every stage plus its hops
    for f in more_in_flight:
        out.append(RunConfig(f"async m=4 {f} in flight", "async", 4, max(6, mb_total // 4), 2,
                             equal, max_in_flight=f))
    out.append(RunConfig("async m=4 skewed", "async", 4, max(6, mb_total // 8), 2, skewed,
                         max_in_flight=in_flight))
    return out


def _time_torch(runs: list[RunConfig], verbose: bool) -> list[float]:
    """One repeat of the baseline: microbatches/s of each run."""
    try:
        roots = run_torch(runs, 3, verbose)
    except BaselineError as e:
        raise SystemExit(f"bench/pipeline.py: {e}\n(--no-torch times ours alone)") from e
    rates = [throughput(c, r) for c, r in zip(runs, roots, strict=True)]
    for c, rate in zip(runs, rates, strict=True):
        log.info("%s: %.2f mb/s", c.name, rate)
    return rates


def _cell(value: float | None, width: int, digits: int) -> str:
    return f" {'-':>{width}}" if value is None else f" {value:>{width}.{digits}f}"


def _emit_baseline(base: list[RunConfig], per: dict[str, list[float]],
                   baseline: dict[str, dict[str, RunConfig]],
                   per_torch: dict[str, list[float]]) -> None:
    """Ours next to torch's schedules on the same work: medians, ratios, theirs / bound."""
    names = list(TORCH_SCHEDULES.values())
    _emit()
    _emit(f"{'schedule':<24} {'m':>3} {'ours mb/s':>10}"
          + "".join(f" {n + ' mb/s':>10}" for n in names)
          + "".join(f" {'ours/' + n:>10}" for n in names)
          + "".join(f" {n + '/bound':>11}" for n in names))
    for c in base:
        ours = statistics.median(per[c.name])
        runs = baseline[c.name]
        theirs = {s: statistics.median(per_torch[r.name]) for s, r in runs.items()}
        ratio = {s: ours / v for s, v in theirs.items()}
        of_bound = {s: v / runs[s].bound() for s, v in theirs.items()}
        _emit(f"{c.name:<24} {c.microbatches:>3} {ours:>10.2f}"
              + "".join(_cell(theirs.get(s), 10, 2) for s in TORCH_SCHEDULES)
              + "".join(_cell(ratio.get(s), 10, 3) for s in TORCH_SCHEDULES)
              + "".join(_cell(of_bound.get(s), 11, 3) for s in TORCH_SCHEDULES))
    _emit("GPipe and 1F1B flush every update (torch has no async schedule): their bound is "
          "sync's with the same m (1F1B can beat it with a slower middle stage: it overlaps the "
          "fill and drain there); 1F1B needs m >= 3 stages ('-')")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--micro", type=int, nargs="+", default=[1, 2, 4, 8],
                        help="microbatches per update for the sync runs")
    parser.add_argument("--cost-ms", type=float, nargs=2, default=[10.0, 20.0],
                        metavar=("FWD", "BWD"), help="per stage, per microbatch sleep")
    parser.add_argument("--microbatches", type=int, default=48,
                        help="microbatches timed per run (after warmup)")
    parser.add_argument("--in-flight", type=int, default=4,
                        help="maxInFlight, microbatches the root keeps in the pipeline")
    parser.add_argument("--more-in-flight", type=int, nargs="*", default=[6],
                        help="extra async m=4 runs with these maxInFlight")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2, help="untimed updates per run")
    parser.add_argument("--no-torch", action="store_true",
                        help="skip the torch.distributed.pipelining baseline (GPipe, 1F1B)")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the baseline's gloo, on 127.0.0.1
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    fwd, bwd = args.cost_ms[0] / 1000, args.cost_ms[1] / 1000
    base = [replace(c, warmup=args.warmup)
            for c in configs(args.micro, fwd, bwd, args.microbatches, args.in_flight,
                             args.more_in_flight)]
    runs = [c for _ in range(args.repeats) for c in base]
    _emit(f"Pipeline of 3 stages, 3 processes, real gRPC on 127.0.0.1; each stage sleeps "
          f"{args.cost_ms[0]:g} ms forward + {args.cost_ms[1]:g} ms backward per microbatch "
          f"(skewed: the middle stage twice that); maxInFlight {args.in_flight}; median of "
          f"{args.repeats} repeats; load average {os.getloadavg()[0]:.1f}")
    overshoot = _sleep_overshoot()
    _emit(f"time.sleep(10 ms) overshoots by {overshoot * 1e3:.2f} ms here (median of 50): the "
          "scheduler's share of every stage's cost")
    started = time.monotonic()
    baseline = {} if args.no_torch else torch_runs(base)
    theirs = list({r.name: r for rs in baseline.values() for r in rs.values()}.values())
    per_torch: dict[str, list[float]] = {c.name: [] for c in theirs}
    if theirs:
        _emit("Baseline: torch.distributed.pipelining (ScheduleGPipe, Schedule1F1B) over gloo, "
              "3 processes, the same stage modules, sleeps, microbatches and updates; the "
              "baseline and ours alternate repeat by repeat")
        reports: list[dict[str, NodeReport]] = []
        for _ in range(args.repeats):
            for cfg, rate in zip(theirs, _time_torch(theirs, args.verbose), strict=True):
                per_torch[cfg.name].append(rate)
            reports += run_nodes(base, 3, args.verbose)
    else:
        reports = run_nodes(runs, 3, args.verbose)
    per: dict[str, list[float]] = {c.name: [] for c in base}
    for cfg, rep in zip(runs, reports, strict=True):
        per[cfg.name].append(throughput(cfg, rep["node_0"]))
        if args.verbose:
            shares = "  ".join(
                f"{n}: " + " ".join(f"{a[:4]} {v / max(sum(r.activity.values()), 1e-9):.2f}"
                                    for a, v in r.activity.items())
                for n, r in sorted(rep.items()))
            log.info("%s: %.2f mb/s; %s", cfg.name, per[cfg.name][-1], shares)
    _emit()
    _emit(f"{'schedule':<24} {'m':>3} {'measured mb/s':>14} {'bound mb/s':>11} {'ratio':>6}"
          f"   repeats")
    for c in base:
        got = statistics.median(per[c.name])
        all_ = " ".join(f"{v:.1f}" for v in per[c.name])
        _emit(f"{c.name:<24} {c.microbatches:>3} {got:>14.2f} {c.bound():>11.2f} "
              f"{got / c.bound():>6.3f}   {all_}")
    _emit()
    _emit("bound: sync m/(sum(f+b) + (m-1) max(f+b)) = m/((m+S-1) c) for equal stages; "
          "async 1/max(f+b)")
    if baseline:
        _emit_baseline(base, per, baseline, per_torch)
    _emit(f"({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
