"""Ring all-reduce: our RingReducer over gRPC and over the TCP data plane versus torch.distributed
gloo, side by side.

Why it exists: clusters average their parameters with `RingReducer.average` (reduce-scatter then
all-gather over our transport). This measures its bus bandwidth against gloo's all_reduce on the
same tensors, in the same rank processes, in the same run, and checks that the result is the mean:
the max abs error against the float64 mean of all ranks' inputs is printed for ours in fp32, ours
with bf16 on the wire (Peer compression="bf16"), and gloo. Both transports a job can choose
(training.ringTransport) are timed: "ours" is the ring over gRPC, "tcp" (the default) the same
RingReducer over dataplane.RingLink/RingServer (authenticated raw-byte connections).

Each rank is a spawned process with a Server + Inbox on a free 127.0.0.1 port, a RingServer
delivering to the same Inbox, and one Peer and one RingLink per compression to its ring successor,
all with the same credentials; gloo's process group (tcp://127.0.0.1) is also used for the
barriers that line the ranks up before every timed call.
What is timed:
- ours: one `RingReducer.average([t], round, movable=1)` call, as training makes it (t moved
  into the reducer's buffer on the first call, then read in place by the ring, which writes the
  mean to a second buffer that t is pointed at when the round completes);
- tcp_outer: a round as training.outer makes it (the pseudo-gradient written, averaged in place,
  the outer step), and tcp_int8 the same round with compression int8 (the pseudo-gradient as
  int8 codes and a scale per 256 values, with error feedback);
- gloo: one `all_reduce(SUM)` of the input pre-scaled by 1/n outside the timer (that yields the
  mean without a timed division).
A repeat's time is the slowest rank's; the median over repeats is reported, after a warmup.
Bus bandwidth = 2 (n - 1) / n * bytes / time (GB = 1e9 bytes).

    python bench/allreduce.py [--ranks 2 4] [--sizes 64 16] [--repeats 5] [--warmup 1]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import multiprocessing as mp
import os
import queue
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ravnest.comm.dataplane import RingLink, RingServer
from ravnest.comm.inboxes import Inbox
from ravnest.comm.transport import Credentials, Peer, Server
from ravnest.plan.plans import RingPlan
from ravnest.spec import OuterSpec
from ravnest.train import heap
from ravnest.train.allreducing import RingReducer
from ravnest.train.outer import OuterStep

log = logging.getLogger("bench.allreduce")

MIB = 1 << 20
CREDS = Credentials(token="bench-token", fingerprint="bench-plan")
VARIANTS = ("ours", "ours_bf16", "tcp", "tcp_bf16", "tcp_ring", "tcp_outer", "tcp_int8", "gloo")
RING_TIMEOUT = 300.0


def _emit(line: str = "") -> None:
    print(line, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _inputs(rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 + rank))


def _exact_mean(world: int, numel: int) -> torch.Tensor:
    total = torch.zeros(numel, dtype=torch.float64)
    for r in range(world):
        total += _inputs(r, numel)
    return total.div_(world)


def _rank(rank: int, world: int, store_port: int, sizes: list[int], repeats: int, warmup: int,
          results: Any) -> None:
    """One rank: set up both transports, then time every variant for every size."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank{rank} %(message)s")
    heap.tune(os.environ)  # as a worker does
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{store_port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=RING_TIMEOUT))
    inbox = Inbox()
    server = Server("127.0.0.1:0", CREDS, inbox.deliver)
    server.start()
    ring_server = RingServer("127.0.0.1:0", CREDS.token, CREDS.fingerprint, inbox.deliver,
                             inbox=inbox)
    ring_server.start()
    ports: list[tuple[int, int]] = [(0, 0)] * world
    dist.all_gather_object(ports, (server.port, ring_server.port))
    members = tuple(f"r{i}" for i in range(world))
    ring = RingPlan(id="bench", members=members, state=())
    succ = ring.successor(members[rank])
    address = f"127.0.0.1:{ports[(rank + 1) % world][0]}"
    ring_address = f"127.0.0.1:{ports[(rank + 1) % world][1]}"
    peers = {c: Peer(address, CREDS, compression=c) for c in ("none", "bf16")}
    for peer in peers.values():
        peer.wait_ready(60)
    links = {c: RingLink(ring_address, CREDS.token, CREDS.fingerprint, members[rank],
                         compression=c, timeout=RING_TIMEOUT) for c in ("none", "bf16")}
    reducers: dict[str, RingReducer] = {
        **{c: RingReducer(ring, members[rank], {succ: p}, inbox, RING_TIMEOUT, compression=c)
           for c, p in peers.items()},
        **{f"tcp_{c}": RingReducer(ring, members[rank], {succ: link}, inbox, RING_TIMEOUT,
                                   compression=c) for c, link in links.items()},
        # (training.outer's round: a reducer of its own, whose buffer its tensors live in)
        "tcp_outer": RingReducer(ring, members[rank], {succ: links["none"]}, inbox,
                                 RING_TIMEOUT),
        # (and with compression int8: the pseudo-gradients as codes, with error feedback)
        "tcp_int8": RingReducer(ring, members[rank], {succ: links["none"]}, inbox,
                                RING_TIMEOUT, compression="int8")}
    round_ = 0
    try:
        for size in sizes:
            numel = size // 4
            source = _inputs(rank, numel)
            scaled = source / world
            # one tensor per variant: average() keeps each in its own reducer's buffer
            works = {name: torch.empty_like(source) for name in VARIANTS}

            def ours(compression: str, work: torch.Tensor,
                     source: torch.Tensor = source) -> Callable[[], tuple[float, float]]:
                def prepare() -> None:
                    work.copy_(source)

                def call() -> None:
                    nonlocal round_
                    round_ += 1
                    if compression == "tcp_ring":  # the ring alone, in place, as gloo's
                        reducers["tcp_none"].all_reduce_(work, round_)
                    elif not reducers[compression].average([work], round_, 1):
                        raise RuntimeError(f"rank {rank}: ring round {round_} was skipped")

                return _pair(prepare, call)

            def outer(work: torch.Tensor, name: str = "tcp_outer",
                      source: torch.Tensor = source) -> Callable[[], tuple[float, float]]:
                """A round as training.outer makes it: the pseudo-gradient (an anchor of zeros,
                the same at every rank, minus the input) averaged in place (it lives in the
                reducer's buffer), then the outer step (SGD, lr 1, no momentum: the mean
                again), which writes the parameters."""
                step = OuterStep(OuterSpec(optimizer="sgd", lr=1.0, momentum=0.0),
                                 {"w": work})

                def prepare() -> None:
                    work.copy_(source)
                    step.anchors["w"].zero_()

                def call() -> None:
                    nonlocal round_
                    round_ += 1
                    if not reducers[name].average(step.pseudo_gradients(), round_, 1, 1):
                        raise RuntimeError(f"rank {rank}: ring round {round_} was skipped")
                    step.step()

                return _pair(prepare, call)

            def gloo(work: torch.Tensor = works["gloo"],
                     scaled: torch.Tensor = scaled) -> Callable[[], tuple[float, float]]:
                return _pair(lambda: work.copy_(scaled), lambda: dist.all_reduce(work))

            variants = {"ours": ours("none", works["ours"]),
                        "ours_bf16": ours("bf16", works["ours_bf16"]),
                        "tcp": ours("tcp_none", works["tcp"]),
                        "tcp_bf16": ours("tcp_bf16", works["tcp_bf16"]),
                        "tcp_ring": ours("tcp_ring", works["tcp_ring"]),
                        "tcp_outer": outer(works["tcp_outer"]),
                        "tcp_int8": outer(works["tcp_int8"], "tcp_int8"), "gloo": gloo()}
            times: dict[str, list[float]] = {k: [] for v in VARIANTS
                                             for k in (v, f"{v}_cpu")}
            for i in range(warmup + repeats):
                order = VARIANTS if i % 2 == 0 else tuple(reversed(VARIANTS))
                for name in order:
                    seconds, cpu = variants[name]()
                    if i >= warmup:
                        times[name].append(seconds)
                        times[f"{name}_cpu"].append(cpu)
            errors, spread = {}, {}
            exact = _exact_mean(world, numel)
            for name in VARIANTS:
                variants[name]()
                out = works[name]
                errors[name] = (out.double() - exact).abs().max().item()
                reference = out.clone()
                dist.broadcast(reference, 0)
                spread[name] = (out - reference).abs().max().item()
            del exact
            results.put((rank, size, times, errors, spread))
    finally:
        for peer in peers.values():
            peer.close()
        for link in links.values():
            link.close()
        ring_server.stop()
        server.stop(0)
        dist.destroy_process_group()


def _pair(prepare: Callable[[], object],
          call: Callable[[], object]) -> Callable[[], tuple[float, float]]:
    """A timed variant: prepare the input, line the ranks up, time the call alone: (wall
    seconds, CPU seconds of every thread of this rank's process)."""
    def run() -> tuple[float, float]:
        prepare()
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        call()
        return time.perf_counter() - start, time.process_time() - cpu

    return run


@contextlib.contextmanager
def spawned(procs: list[Any]) -> Iterator[None]:
    """Start the rank processes; when the block ends, give each a minute to exit, and stop
    those still there."""
    for p in procs:
        p.start()
    try:
        yield
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()


def next_result(results: Any, procs: list[Any]) -> Any:
    """The next item a rank put on `results`; RuntimeError as soon as a rank died instead."""
    while True:
        try:
            return results.get(timeout=5)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"{dead[0].name} exited with {dead[0].exitcode}") from None


def _run_world(world: int, sizes: list[int], repeats: int,
               warmup: int) -> dict[int, dict[str, Any]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store_port = _free_port()
    procs = [ctx.Process(target=_rank, name=f"rank{r}",
                         args=(r, world, store_port, sizes, repeats, warmup, results))
             for r in range(world)]
    collected: dict[int, dict[str, Any]] = {s: {"times": [], "errors": [], "spread": []}
                                            for s in sizes}
    with spawned(procs):
        for _ in range(world * len(sizes)):
            rank, size, times, errors, spread = next_result(results, procs)
            log.info("%d ranks, %d MiB, rank %d: %s", world, size // MIB, rank, times)
            entry = collected[size]
            entry["times"].append(times)
            entry["errors"].append(errors)
            entry["spread"].append(spread)
    return collected


def _summary(world: int, size: int, entry: dict[str, Any]) -> dict[str, float]:
    """Per variant: median over repeats of the slowest rank's time, worst error and spread."""
    out: dict[str, float] = {}
    for name in VARIANTS:
        per_repeat = zip(*(t[name] for t in entry["times"]), strict=True)
        seconds = statistics.median(max(r) for r in per_repeat)
        out[f"{name}_s"] = seconds
        out[f"{name}_bus"] = 2 * (world - 1) / world * size / seconds / 1e9
        out[f"{name}_err"] = max(e[name] for e in entry["errors"])
        out[f"{name}_spread"] = max(s[name] for s in entry["spread"])
        out[f"{name}_cpu"] = statistics.median(
            statistics.mean(r) for r in zip(*(t[f"{name}_cpu"] for t in entry["times"]),
                                            strict=True))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 16],
                        help="float32 MiB per rank")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("-v", "--verbose", action="store_true", help="log every rank's times")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

    sizes = [s * MIB for s in args.sizes]
    rows: list[tuple[int, int, dict[str, float]]] = []
    for world in args.ranks:
        collected = _run_world(world, sizes, args.repeats, args.warmup)
        rows.extend((world, s, _summary(world, s, collected[s])) for s in sizes)

    _emit(f"Ring all-reduce on 127.0.0.1, one process per rank; median of {args.repeats} "
          f"(slowest rank); bus GB/s = 2(n-1)/n * bytes / time")
    _emit(f"{'ranks':>5} {'size':>7} {'ours ms':>8} {'gloo ms':>8} {'ours bus':>9} "
          f"{'gloo bus':>9} {'ours/gloo':>9} {'ours max err':>13} {'gloo max err':>13}")
    for world, size, s in rows:
        _emit(f"{world:>5} {size // MIB:>4}MiB {s['ours_s'] * 1e3:>8.1f} {s['gloo_s'] * 1e3:>8.1f} "
              f"{s['ours_bus']:>9.3f} {s['gloo_bus']:>9.3f} {s['gloo_s'] / s['ours_s']:>9.2f} "
              f"{s['ours_err']:>13.2e} {s['gloo_err']:>13.2e}")
    _emit()
    _emit("CPU seconds per call and rank (every thread of the rank's process; mean over ranks, "
          "median over repeats): the ring is CPU-bound here when ours/gloo CPU ~ gloo/ours time")
    _emit(f"{'ranks':>5} {'size':>7} {'ours cpu ms':>12} {'gloo cpu ms':>12} {'ours/gloo cpu':>14}")
    for world, size, s in rows:
        _emit(f"{world:>5} {size // MIB:>4}MiB {s['ours_cpu'] * 1e3:>12.1f} "
              f"{s['gloo_cpu'] * 1e3:>12.1f} {s['ours_cpu'] / s['gloo_cpu']:>14.2f}")
    _emit()
    _emit("bf16 on the wire (ours, Peer compression='bf16'); error against the exact fp32 mean; "
          "spread = max |rank result - rank 0 result|")
    _emit(f"{'ranks':>5} {'size':>7} {'bf16 ms':>8} {'bf16 bus':>9} {'vs ours fp32':>13} "
          f"{'bf16 max err':>13} {'bf16 spread':>12} {'fp32 spread':>12}")
    for world, size, s in rows:
        _emit(f"{world:>5} {size // MIB:>4}MiB {s['ours_bf16_s'] * 1e3:>8.1f} "
              f"{s['ours_bf16_bus']:>9.3f} {s['ours_s'] / s['ours_bf16_s']:>12.2f}x "
              f"{s['ours_bf16_err']:>13.2e} {s['ours_bf16_spread']:>12.2e} "
              f"{s['ours_spread']:>12.2e}")
    _emit()
    _emit("The same RingReducer on the TCP data plane (training.ringTransport: tcp), same run. "
          "tcp = average() as training calls it (read in place, the mean written to a second "
          "buffer the parameters are pointed at when the round completes: a failed round "
          "leaves them untouched); ring = all_reduce_() alone, in place on the flat tensor, "
          "as gloo's all_reduce")
    _emit(f"{'ranks':>5} {'size':>7} {'tcp ms':>8} {'gloo ms':>8} {'tcp bus':>9} {'tcp/gloo':>9} "
          f"{'tcp/ours':>9} {'ring ms':>8} {'ring/gloo':>10} {'tcp cpu ms':>11} "
          f"{'ring cpu ms':>12} {'tcp max err':>12} {'bf16 ms':>8} "
          f"{'bf16/tcp':>9} {'bf16 err':>9} {'bf16 spread':>12}")
    for world, size, s in rows:
        _emit(f"{world:>5} {size // MIB:>4}MiB {s['tcp_s'] * 1e3:>8.1f} {s['gloo_s'] * 1e3:>8.1f} "
              f"{s['tcp_bus']:>9.3f} {s['gloo_s'] / s['tcp_s']:>9.2f} "
              f"{s['ours_s'] / s['tcp_s']:>9.2f} {s['tcp_ring_s'] * 1e3:>8.1f} "
              f"{s['gloo_s'] / s['tcp_ring_s']:>10.2f} {s['tcp_cpu'] * 1e3:>11.1f} "
              f"{s['tcp_ring_cpu'] * 1e3:>12.1f} "
              f"{max(s['tcp_err'], s['tcp_ring_err']):>12.2e} {s['tcp_bf16_s'] * 1e3:>8.1f} "
              f"{s['tcp_s'] / s['tcp_bf16_s']:>8.2f}x {s['tcp_bf16_err']:>9.2e} "
              f"{s['tcp_bf16_spread']:>12.2e}")
    _emit()
    _emit("A round with training.outer (tcp): the pseudo-gradient written, averaged in place "
          "by average() (it lives in the reducer's buffer), and the outer step, which writes "
          "the parameters; against tcp's average() of the parameters, same run")
    _emit(f"{'ranks':>5} {'size':>7} {'outer ms':>9} {'tcp ms':>8} {'outer/tcp':>10} "
          f"{'outer cpu ms':>13} {'outer max err':>14}")
    for world, size, s in rows:
        _emit(f"{world:>5} {size // MIB:>4}MiB {s['tcp_outer_s'] * 1e3:>9.1f} "
              f"{s['tcp_s'] * 1e3:>8.1f} {s['tcp_outer_s'] / s['tcp_s']:>10.2f} "
              f"{s['tcp_outer_cpu'] * 1e3:>13.1f} {s['tcp_outer_err']:>14.2e}")
    _emit()
    _emit("The same outer round with compression int8 (tcp): the pseudo-gradients as int8 codes "
          "and a float32 scale per 256 (1.016 bytes a value on the wire, 3.9x less), with error "
          "feedback; its max err is one round's rounding (the last of the repeats); spread = "
          "max |rank result - rank 0 result|")
    _emit(f"{'ranks':>5} {'size':>7} {'int8 ms':>8} {'outer ms':>9} {'int8/outer':>11} "
          f"{'int8/gloo':>10} {'int8 cpu ms':>12} {'int8 max err':>13} {'int8 spread':>12}")
    for world, size, s in rows:
        _emit(f"{world:>5} {size // MIB:>4}MiB {s['tcp_int8_s'] * 1e3:>8.1f} "
              f"{s['tcp_outer_s'] * 1e3:>9.1f} {s['tcp_int8_s'] / s['tcp_outer_s']:>11.2f} "
              f"{s['gloo_s'] / s['tcp_int8_s']:>10.2f} {s['tcp_int8_cpu'] * 1e3:>12.1f} "
              f"{s['tcp_int8_err']:>13.2e} {s['tcp_int8_spread']:>12.2e}")


if __name__ == "__main__":
    main()
