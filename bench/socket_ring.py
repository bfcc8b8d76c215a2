"""What the ring could reach without gRPC: the same ring on plain TCP sockets, beside gloo.

Why it exists: our ring (bench/allreduce.py) runs at 0.25-0.33 of gloo here and is CPU-bound in
grpc-python's per-message work, not in its own arithmetic. This script runs the same algorithm
(reduce-scatter then all-gather, 4 MiB pieces, a sender thread so sending overlaps receiving and
adding) on plain TCP sockets, receiving with `recv_into` straight into a preallocated buffer (or
into the gathered piece itself), and times it against gloo `all_reduce` on the same tensors in
the same processes. It is a measurement for a design decision, NOT the product path: no
authentication, no TLS, no skipped rounds, no timeouts. It shows what a bulk data plane beside
gRPC (gRPC keeping the control messages and authenticating a socket's first bytes) would buy.

    python bench/socket_ring.py [--ranks 2 4] [--size 64] [--repeats 5] [--bf16]

`--bf16` also times the ring with bf16 on the wire, in turn with fp32 and gloo in each repeat.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import socket
import statistics
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

PIECE = 1 << 20
"""float32 elements per piece (4 MiB), as the gRPC ring's PIECE_BYTES."""


def _bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous 1-d tensor, without a copy (numpy has no bfloat16)."""
    return memoryview(t.view(torch.uint8).numpy())


def _recv_exact(sock: socket.socket, out: torch.Tensor) -> None:
    view = _bytes(out)
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the ring socket")
        got += n


def ring_all_reduce(rank: int, n: int, to_next: socket.socket, from_prev: socket.socket,
                    flat: torch.Tensor, scratch: torch.Tensor, wire: torch.dtype) -> None:
    """Average `flat` in place with the other ranks (ring order by rank)."""
    pieces = [list(seg.split(PIECE)) for seg in flat.tensor_split(n)]
    outgoing: queue.Queue[torch.Tensor | None] = queue.Queue()

    def sender() -> None:
        while (t := outgoing.get()) is not None:
            to_next.sendall(_bytes(t))

    thread = threading.Thread(target=sender)
    thread.start()

    def post(p: torch.Tensor) -> None:
        outgoing.put(p.to(wire) if wire != torch.float32 else p)

    try:
        for p in pieces[rank]:
            post(p)
        for s in range(n - 1):
            for p in pieces[(rank - s - 1) % n]:
                got = scratch[:p.numel()]
                _recv_exact(from_prev, got)
                p.add_(got)
                if s == n - 2:
                    p.div_(n)
                    if wire != torch.float32:
                        p.copy_(p.to(wire))  # keep what the others receive
                post(p)
        for s in range(n - 1):
            for p in pieces[(rank - s) % n]:
                if wire == torch.float32:
                    _recv_exact(from_prev, p)
                else:
                    got = scratch[:p.numel()]
                    _recv_exact(from_prev, got)
                    p.copy_(got)
                if s < n - 2:
                    post(p)
    finally:
        outgoing.put(None)
        thread.join()


def _rank(rank: int, n: int, ports: list[int], store_port: int, numel: int, repeats: int,
          wires: list[torch.dtype], results: Any) -> None:
    torch.set_num_threads(1)
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", ports[rank]))
    server.listen(1)
    deadline = time.monotonic() + 60
    while True:
        try:
            to_next = socket.create_connection(("127.0.0.1", ports[(rank + 1) % n]))
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    from_prev, _ = server.accept()
    for s in (to_next, from_prev):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{store_port}", rank=rank,
                            world_size=n)
    torch.manual_seed(rank)
    x = torch.randn(numel)
    scratch = {w: torch.empty(PIECE, dtype=w) for w in wires}
    times: dict[str, list[float]] = {"gloo": [], **{str(w): [] for w in wires}}
    err = {str(w): 0.0 for w in wires}
    for _ in range(repeats + 1):  # the first of each is a warmup
        results_here = {}
        for w in wires:
            a = x.clone()
            dist.barrier()
            t = time.perf_counter()
            ring_all_reduce(rank, n, to_next, from_prev, a, scratch[w], w)
            times[str(w)].append(time.perf_counter() - t)
            results_here[str(w)] = a
        b = x.clone()
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(b)
        times["gloo"].append(time.perf_counter() - t)
        for w, a in results_here.items():
            err[w] = max(err[w], float((a - b / n).abs().max()))
    results.put((rank, {k: statistics.median(v[1:]) for k, v in times.items()}, err))
    dist.destroy_process_group()
    for s in (to_next, from_prev, server):
        s.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--size", type=float, default=64, help="float32 MiB per rank")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bf16", action="store_true",
                        help="also the same ring with bf16 on the wire, in the same run")
    args = parser.parse_args()
    from ravnest.run.local import free_ports

    wires = [torch.float32] + ([torch.bfloat16] if args.bf16 else [])
    numel = int(args.size * (1 << 20)) // 4
    print(f"Ring on plain TCP sockets (no auth, prototype) vs gloo all_reduce, {args.size:g} MiB "
          f"float32 per rank, fp32{' and bf16' if args.bf16 else ''} on the wire, taken in turn "
          f"each repeat; median of {args.repeats}, slowest rank; max err against gloo's mean",
          flush=True)
    head = f"{'ranks':>5} {'fp32 ms':>8} {'gloo ms':>8} {'fp32/gloo speed':>16} {'max err':>9}"
    if args.bf16:
        head += f" {'bf16 ms':>8} {'bf16/fp32 speed':>16} {'bf16 err':>9}"
    print(head, flush=True)
    ctx = mp.get_context("spawn")
    for n in args.ranks:
        *ports, store = free_ports(n + 1)
        results = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, n, ports, store, numel, args.repeats, wires,
                                                 results)) for r in range(n)]
        for p in procs:
            p.start()
        got = [results.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(timeout=60)

        slowest = {k: max(g[1][k] for g in got) for k in got[0][1]}
        error = {k: max(g[2][k] for g in got) for k in got[0][2]}
        fp32, gloo = slowest[str(torch.float32)], slowest["gloo"]
        line = (f"{n:>5} {fp32 * 1e3:>8.1f} {gloo * 1e3:>8.1f} {gloo / fp32:>16.2f} "
                f"{error[str(torch.float32)]:>9.2e}")
        if args.bf16:
            bf16 = slowest[str(torch.bfloat16)]
            line += (f" {bf16 * 1e3:>8.1f} {fp32 / bf16:>16.2f} "
                     f"{error[str(torch.bfloat16)]:>9.2e}")
        print(line, flush=True)

if __name__ == "__main__":
    main()
