"""GPU: a GPT's pipeline against plain torch, its losses, a ring round and memory per stage.

Why it exists: a provider's stage trains on its CUDA device (spec.providers[].device), and what
that is worth shows only beside plain PyTorch on the same GPU. In one run on one GPU:

(a) a GPT of about 100M parameters (`ravnest.examples.sorter`, 14 blocks of 768, sequences of
    127 tokens) in bf16, as `ravnest run` trains it with 2 and with 3 stages (one cluster, every
    stage a worker process on the same GPU, sync schedule), against the same model trained by
    one plain torch process on the same batches, the same optimizer and the same autocast:
    samples/s of each in the steady state (the root's `ravnest_samples_total` over the last 3/4
    of the training it was seen moving; torch: the updates after its warmup) and their ratio;
(b) the 2-stage run's training loss at every update against plain torch's (bf16 both: the
    pipeline's microbatches round differently from one whole batch);
(c) one ring round of 256 MiB of CUDA tensors between 2 processes: `RingReducer.average` over the
    TCP data plane (as training calls it, the device tensors copied through a pinned buffer)
    against `torch.distributed` gloo's all_reduce of the same CUDA tensors;
(d) the most memory torch held on the GPU per stage (each worker's
    `ravnest_device_memory_peak_bytes`) against the plan's estimate for that stage;
(e) where a ring round's reducing is faster, on the host or on the device: one rank's share of
    a round of 256 MiB in rings of 2 and 4 members, its pieces arriving in pinned host memory
    as the data plane receives them, no network: on the host (what `RingReducer` does: the
    device tensors copied into a pinned buffer at once, the pieces added there by the CPU, the
    result copied back at once) against on the device (each piece copied over and added there,
    each sum the next member needs copied back to pinned memory to be sent).

    python bench/gpu.py [--stages 2 3] [--updates 40] [--ring-mib 256] [--device cuda]
    python bench/gpu.py --device cpu --small     (a dry run of the same code on a CPU)
"""

from __future__ import annotations

import argparse
import csv
import datetime
import logging
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from allreduce import _free_port, next_result, spawned
from e2e import run_scraped

from ravnest import parse_job
from ravnest.comm.dataplane import RingLink, RingServer
from ravnest.comm.inboxes import Inbox
from ravnest.plan import building
from ravnest.plan.plans import RingPlan
from ravnest.run.worker import cluster_batches
from ravnest.spec import Job
from ravnest.train.allreducing import RingReducer
from ravnest.train.devices import Placement

log = logging.getLogger("bench.gpu")
MIB = 1 << 20
WARMUP = 8
"""Updates of plain torch left out of its timing (kernels chosen, allocator grown)."""


def _emit(line: str = "") -> None:
    print(line, flush=True)


def gpt_job(stages: int, updates: int, device: str, small: bool) -> Job:
    """The GPT job: `stages` providers on `device` in one cluster, bf16, `updates` updates of
    64 samples in 4 microbatches (one epoch, no validation, no checkpoints)."""
    dim, layers, heads, length = (64, 4, 4, 16) if small else (768, 14, 12, 64)
    batch = 64
    return parse_job({
        "apiVersion": "ravnest.io/v1alpha1", "kind": "RavnestJob",
        "metadata": {"name": f"gpu-bench-{stages}"},
        "spec": {
            "model": {"entrypoint": "ravnest.examples.sorter:build_model",
                      "kwargs": {"vocab": 16, "length": length, "dim": dim, "layers": layers,
                                 "heads": heads},
                      "exampleInput": {"shape": [batch, 2 * length - 1], "dtype": "int64",
                                       "high": 16}},
            "data": {"entrypoint": "ravnest.examples.sorter:datasets",
                     "kwargs": {"n_train": batch * updates, "n_val": batch, "vocab": 16,
                                "length": length},
                     "batchSize": batch, "microbatches": 4, "seed": 1},
            "training": {"epochs": 1, "optimizer": {"name": "AdamW", "params": {"lr": 3e-4}},
                         "criterion": {"name": "NLLLoss"}, "precision": "bf16",
                         "validationFrequency": 100},
            "plan": {"clusters": 1},
            "checkpoint": {"everySteps": 0},
            "providers": [{"ram": 40, "device": device, "replicas": stages}],
        }})


def steady_rate(samples: list[tuple[float, float]]) -> float:
    """Samples/s over the last 3/4 of the time the count was seen moving."""
    moving = [(t, v) for t, v in samples if v > 0]
    if len(moving) < 3:
        return float("nan")
    t0 = moving[0][0] + (moving[-1][0] - moving[0][0]) / 4
    tail = [(t, v) for t, v in moving if t >= t0]
    if len(tail) < 2 or tail[-1][0] == tail[0][0]:
        return float("nan")
    return (tail[-1][1] - tail[0][1]) / (tail[-1][0] - tail[0][0])


def run_ours(job: Job) -> dict[str, Any]:
    """`ravnest run` of the job, its workers scraped: the steady rate, the losses per update,
    each node's GPU memory peak and planned memory."""
    def losses(out: Path) -> list[float]:
        with open(out / "learning_curve.csv") as f:
            return [float(r["train_loss"]) for r in csv.DictReader(f) if r["train_loss"]]

    got = run_scraped(job, losses)
    plan, scrapes = got["plan"], got["scrapes"]
    root = plan.clusters[0].nodes[0]
    return {"rate": steady_rate(scrapes[root].samples), "losses": got["read"],
            "summary": got["summary"],
            "memory": {n.name: (scrapes[n.name].device_peak, n.memory_bytes, n.params)
                       for n in plan.nodes}}


def run_torch(job: Job, device: str) -> dict[str, Any]:
    """The same model, initialised the same, trained by one plain process on the same batches
    with the same optimizer and autocast: samples/s after the warmup, the loss of each update."""
    spec = job.spec
    model = building.build_model(spec).to(device)
    train, val = building.build_datasets(spec)
    batches = cluster_batches(train, val, spec, 0, 1)
    opt = building.build_optimizer(spec, list(model.parameters()))
    criterion = building.build_criterion(spec)
    placement = Placement(torch.device(device), spec.training.precision)
    losses, stamps = [], []
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for (x,), y in batches.train(0):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with placement.autocast():
            loss = criterion(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))  # (the update's end: its loss read, as a loop would)
        sync()
        stamps.append(time.perf_counter())
    timed = stamps[WARMUP:]
    rate = spec.data.batch_size * (len(timed) - 1) / (timed[-1] - timed[0])
    return {"rate": rate, "losses": losses}


# ------------------------------------------------------------------------------- (c) the ring

def _ring_rank(rank: int, store_port: int, numel: int, repeats: int, device: str,
               results: Any) -> None:
    """One of 2 ranks: time RingReducer.average over the data plane and gloo's all_reduce on
    the same CUDA tensors, alternating, after one warmup of each."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{store_port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=300))
    token, fp = "bench-token", "bench-plan"
    inbox = Inbox()
    server = RingServer("127.0.0.1:0", token, fp, inbox.deliver, inbox=inbox)
    server.start()
    ports = [0, 0]
    dist.all_gather_object(ports, server.port)
    members = ("r0", "r1")
    ring = RingPlan(id="bench", members=members, state=())
    link = RingLink(f"127.0.0.1:{ports[1 - rank]}", token, fp, members[rank], timeout=300.0)
    reducer = RingReducer(ring, members[rank], {members[1 - rank]: link}, inbox, 300.0)
    source = torch.randn(numel, generator=torch.Generator().manual_seed(rank)).to(device)
    ours_t, gloo_t = torch.empty_like(source), torch.empty_like(source)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    times: dict[str, list[float]] = {"ours": [], "gloo": []}
    try:
        for i in range(repeats + 1):
            ours_t.copy_(source)
            gloo_t.copy_(source / 2)
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            if not reducer.average([ours_t], i + 1, 1):
                raise RuntimeError(f"rank {rank}: round {i + 1} skipped")
            sync()
            t1 = time.perf_counter()
            dist.barrier()
            t2 = time.perf_counter()
            dist.all_reduce(gloo_t)
            sync()
            t3 = time.perf_counter()
            if i:
                times["ours"].append(t1 - t0)
                times["gloo"].append(t3 - t2)
        error = (ours_t - gloo_t).abs().max().item()
        results.put((rank, times, error, str(ours_t.device)))
    finally:
        link.close()
        server.stop()
        dist.destroy_process_group()


def run_ring(mib: int, repeats: int, device: str) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_ring_rank, args=(r, port, mib * MIB // 4, repeats, device,
                                                 results)) for r in range(2)]
    with spawned(procs):
        got = [next_result(results, procs) for _ in procs]
    ours = statistics.median(max(a, b) for a, b in zip(got[0][1]["ours"], got[1][1]["ours"],
                                                       strict=True))
    gloo = statistics.median(max(a, b) for a, b in zip(got[0][1]["gloo"], got[1][1]["gloo"],
                                                       strict=True))
    return {"ours": ours, "gloo": gloo, "error": max(g[2] for g in got), "on": got[0][3]}


# --------------------------------------------------------- (e) reduce on the host or the device

def _reduce_on_host(params: torch.Tensor, pieces: list[torch.Tensor], flat: torch.Tensor) -> None:
    """One rank's share of a ring round, reduced on the host: the parameters to a pinned buffer,
    each reduce-scatter piece added there by the CPU, each all-gather piece copied in, the result
    back to the device."""
    k = len(pieces) // 2 + 1
    chunk = flat.numel() // k
    flat.copy_(params, non_blocking=True)
    torch.cuda.synchronize()
    for step, piece in enumerate(pieces):
        mine = flat[(step % k) * chunk:(step % k + 1) * chunk]
        if step < k - 1:
            mine.add_(piece)
        else:
            mine.copy_(piece)
    params.copy_(flat, non_blocking=True)
    torch.cuda.synchronize()


def _reduce_on_device(params: torch.Tensor, pieces: list[torch.Tensor],
                      outgoing: torch.Tensor) -> None:
    """The same share reduced on the device: each piece copied over and added (or, gathering,
    written) there; each partial sum copied back to pinned memory, to be sent on."""
    k = len(pieces) // 2 + 1
    chunk = params.numel() // k
    for step, piece in enumerate(pieces):
        mine = params[(step % k) * chunk:(step % k + 1) * chunk]
        if step < k - 1:
            mine.add_(piece.to(params.device, non_blocking=True))
            outgoing[:chunk].copy_(mine, non_blocking=True)
            torch.cuda.synchronize()  # (the sum goes on the wire next)
        else:
            mine.copy_(piece, non_blocking=True)
    torch.cuda.synchronize()


def run_reduce_placement(mib: int, members: int, repeats: int) -> dict[str, float]:
    numel = mib * MIB // 4 // members * members
    chunk = numel // members
    params = torch.randn(numel, device="cuda")
    pieces = [torch.randn(chunk, pin_memory=True) for _ in range(2 * (members - 1))]
    flat = torch.empty(numel, pin_memory=True)
    outgoing = torch.empty(chunk, pin_memory=True)
    got: dict[str, list[float]] = {"host": [], "device": []}
    for i in range(repeats + 1):
        for name, run in (("host", lambda: _reduce_on_host(params, pieces, flat)),
                          ("device", lambda: _reduce_on_device(params, pieces, outgoing))):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run()
            if i:
                got[name].append(time.perf_counter() - t0)
    return {name: statistics.median(times) for name, times in got.items()}


# ------------------------------------------------------------------------------------ report

def _losses(ours: list[float], plain: list[float]) -> tuple[float, float]:
    n = min(len(ours), len(plain))
    diffs = [abs(a - b) for a, b in zip(ours[:n], plain[:n], strict=True)]
    rel = [d / max(abs(b), 1e-6) for d, b in zip(diffs, plain[:n], strict=True)]
    return max(diffs), max(rel)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--updates", type=int, default=40)
    parser.add_argument("--ring-mib", type=int, default=256)
    parser.add_argument("--ring-repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a small GPT (a CPU dry run)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if args.device.startswith("cuda"):
        _emit(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    tolerance = 0.05
    failed = False
    ours_losses: list[float] = []
    plain_losses: list[float] = []
    _emit("(a) samples/s, steady state (one cluster, every stage a process on the one device)")
    _emit(f"{'stages':>6} {'params':>8} {'ravnest':>9} {'torch':>9} {'ratio':>6} "
          f"{'accuracy':>8}")
    memory: dict[int, dict[str, tuple[float, int, int]]] = {}
    for stages in args.stages:
        job = gpt_job(stages, args.updates + WARMUP, args.device, args.small)
        try:
            ours = run_ours(job)
            plain = run_torch(job, args.device)
        except Exception as e:  # (the other figures stand)
            failed = True
            _emit(f"{stages:>6} failed: {type(e).__name__}: {e}")
            continue
        params = sum(m[2] for m in ours["memory"].values())
        _emit(f"{stages:>6} {params / 1e6:>7.1f}M {ours['rate']:>9.1f} {plain['rate']:>9.1f} "
              f"{ours['rate'] / plain['rate']:>6.2f} "
              f"{ours['summary'].get('fused_val_metric') or float('nan'):>8.3f}")
        memory[stages] = ours["memory"]
        if stages == args.stages[0]:
            ours_losses, plain_losses = ours["losses"], plain["losses"]
    _emit()
    worst, rel = _losses(ours_losses, plain_losses) if ours_losses else (float("nan"),) * 2
    ok = rel <= tolerance
    failed |= not ok
    _emit(f"(b) training loss per update, {args.stages[0]} stages against plain torch (bf16 "
          f"both), {min(len(ours_losses), len(plain_losses))} updates: max |diff| {worst:.4f}, "
          f"max relative {rel:.2%} ({'within' if ok else 'OVER'} {tolerance:.0%})")
    _emit(f"    first losses ravnest {[round(x, 4) for x in ours_losses[:5]]}")
    _emit(f"    first losses torch   {[round(x, 4) for x in plain_losses[:5]]}")
    _emit(f"    last  losses ravnest {[round(x, 4) for x in ours_losses[-3:]]}, torch "
          f"{[round(x, 4) for x in plain_losses[-3:]]}")
    _emit()
    _emit("(d) peak device memory per stage against the plan's estimate")
    _emit(f"{'stages':>6} {'node':>7} {'params':>8} {'peak MiB':>9} {'plan MiB':>9} "
          f"{'peak/plan':>9}")
    for stages, nodes in memory.items():
        for node, (peak, planned, params) in nodes.items():
            _emit(f"{stages:>6} {node:>7} {params / 1e6:>7.1f}M {peak / MIB:>9.0f} "
                  f"{planned / MIB:>9.0f} {peak / planned if planned else float('nan'):>9.2f}")
    _emit()
    try:
        ring = run_ring(args.ring_mib, args.ring_repeats, args.device)
    except Exception as e:  # (the other figures stand)
        failed = True
        _emit(f"(c) the ring round failed: {type(e).__name__}: {e}")
    else:
        _emit(f"(c) one ring round of {args.ring_mib} MiB on {ring['on']}, 2 processes, median "
              f"of {args.ring_repeats} (slowest rank): ravnest tcp ring "
              f"{ring['ours'] * 1e3:.1f} ms, gloo {ring['gloo'] * 1e3:.1f} ms, ravnest/gloo "
              f"time {ring['ours'] / ring['gloo']:.2f}; max |ravnest - gloo| "
              f"{ring['error']:.2e}")
    _emit()
    if not args.device.startswith("cuda"):
        _emit("(e) reduce on the host or the device: not run (no CUDA device)")
    else:
        _emit(f"(e) one rank's share of a ring round of {args.ring_mib} MiB, pieces in pinned "
              f"memory, no network, median of {args.ring_repeats}:")
        for members in (2, 4):
            r = run_reduce_placement(args.ring_mib, members, args.ring_repeats)
            faster = "host" if r["host"] <= r["device"] else "device"
            _emit(f"    {members} members: on the host {r['host'] * 1e3:.1f} ms, on the device "
                  f"{r['device'] * 1e3:.1f} ms, device/host {r['device'] / r['host']:.2f}: the "
                  f"{faster} is faster")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
