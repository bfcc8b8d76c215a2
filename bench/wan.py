"""The paper model against a measurement: our ring all-reduce and point-to-point transfer over
links with added latency and limited bandwidth, between hosts in network namespaces.

Why it exists: on this machine every other figure is taken over loopback, where the CPU is the
limit. Providers of a real job sit behind internet links (10-1000 Mbps, 20-150 ms), where bandwidth
and latency are. `docs/performance.md` models our ring and transfer times from n, S, B, d and the
piece size; this script builds such a network and checks the model against it.

The kernel of this machine has no netem qdisc (`tc qdisc add ... netem` answers "Specified qdisc
kind is unknown"; tbf and htb exist). So the rate is limited by tbf on each host's uplink, and the
latency is added by a delay line: a small asyncio TCP proxy in the sender's namespace that forwards
every chunk it reads `D` seconds later, in order, both ways (what Toxiproxy's latency toxic does).

Topology (all made here, all removed at the end; needs root, iproute2 and tc):
    netns rvb-sw: one bridge
    netns rvb-h0 .. rvb-h{n-1}: one host each, a veth into the bridge, address 10.213.0.(i+1)
Each host's uplink (its veth's egress) gets `tbf rate B`, and its rank reaches its successor
through the delay line, so a hop costs one-way latency D (round trip 2D) and at most B bits/s
per host. One rank process runs in
each host's namespace (`ip netns exec`) with our Server, a Peer to its successor, and a
RingReducer whose pieces go over gRPC (the Peer) or, with `--transports tcp`, over the data plane
(a RingServer and a RingLink to the successor's, through a delay line of its own); rank 0 also
times Peer.send of one tensor to rank 1, and a burst of 8 ordered Peer.posts of 2 MiB (a pipeline
hop's activations) with the flush after them.

For every (n, D, B) it prints measured and modelled times and their ratio (the model and its
terms are in docs/performance.md):
    ring   T = 2(n-1) * max(k * max(P/B, (P/B + 2D) / c), P/B + D) + 2D   (gRPC: a call a piece)
           T = 2(n-1) * max(k * P/B, P/B + D) + D                          (tcp: one stream)
    send   T = S/B + 2D   (the stream, then the Ack)
    posts  T = 8 * max(A/B, (A/B + 2D) / c) + 2D
with S bytes per rank, P the ring's piece size, k = ceil(S/(n P)) pieces per ring step,
A = 2 MiB and c = 1 + lanes the calls in flight
per peer (--lanes 0: one sender thread, one call at a time, as before the lanes existed).

    python bench/wan.py [--ranks 2 3] [--delays 0 20 50] [--rates 100 1000] [--size 8]
                          [--rounds 3] [--lanes 0 4] [--transports grpc tcp]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("bench.wan")

PREFIX = "rvb"
SUBNET = "10.213.0"
PORT = 47000
PROXY_PORT = 47001
RING_PORT = 47002
"""The data plane's port (--transports tcp), reached through a delay line on RING_PROXY_PORT."""
RING_PROXY_PORT = 47003
MIB = 1 << 20
TOKEN = "bench-netem-token"
CALLS = 5
"""Calls in flight per peer: 1 + transport.UNORDERED_LANES sender threads (not imported here:
the model must print without torch and grpc)."""
POSTS = 8
"""Ordered frames rank 0 posts in a burst (activations of 8 microbatches)."""


def _emit(line: str = "") -> None:
    print(line, flush=True)


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _tc(netns: str, *args: str) -> None:
    subprocess.run(["ip", "netns", "exec", netns, "tc", *args], check=True,
                   capture_output=True, text=True)


def _cleanup(n: int) -> None:
    for name in [f"{PREFIX}-sw", *(f"{PREFIX}-h{i}" for i in range(n))]:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@contextlib.contextmanager
def network(n: int) -> Iterator[list[str]]:
    """n hosts on one bridge; yields their addresses. Removes everything afterwards."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            raise SystemExit(f"bench/wan.py needs {tool} (iproute2) and root")
    _cleanup(n)
    try:
        _ip("netns", "add", f"{PREFIX}-sw")
        _ip("link", "add", "br0", "type", "bridge", netns=f"{PREFIX}-sw")
        _ip("link", "set", "br0", "up", netns=f"{PREFIX}-sw")
        addresses = []
        for i in range(n):
            host = f"{PREFIX}-h{i}"
            _ip("netns", "add", host)
            _ip("link", "add", "eth0", "netns", host, "type", "veth", "peer", "name", f"p{i}",
                "netns", f"{PREFIX}-sw")
            _ip("link", "set", f"p{i}", "master", "br0", netns=f"{PREFIX}-sw")
            _ip("link", "set", f"p{i}", "up", netns=f"{PREFIX}-sw")
            address = f"{SUBNET}.{i + 1}"
            _ip("addr", "add", f"{address}/24", "dev", "eth0", netns=host)
            _ip("link", "set", "eth0", "up", netns=host)
            _ip("link", "set", "lo", "up", netns=host)
            addresses.append(address)
        yield addresses
    finally:
        _cleanup(n)


def shape_links(rates_mbit: list[float]) -> None:
    """Host i's uplink limited to rates_mbit[i] Mbit/s (tbf; its queue holds a second of
    traffic)."""
    for i, rate_mbit in enumerate(rates_mbit):
        rate = rate_mbit * 1e6 / 8
        burst = max(64 << 10, int(rate / 250))
        _tc(f"{PREFIX}-h{i}", "qdisc", "replace", "dev", "eth0", "root", "tbf",
            "rate", f"{rate_mbit}mbit", "burst", str(burst), "limit", str(int(rate) + burst))


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                delay: float) -> None:
    """Forward bytes, each chunk `delay` seconds after it was read (a delay line: order kept,
    throughput not limited)."""
    line: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def emit() -> None:
        loop = asyncio.get_running_loop()
        while True:
            due, data = await line.get()
            if not data:
                break
            if (wait := due - loop.time()) > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        writer.close()

    task = asyncio.create_task(emit())
    loop = asyncio.get_running_loop()
    try:
        while data := await reader.read(1 << 16):
            line.put_nowait((loop.time() + delay, data))
    except ConnectionError:
        pass
    line.put_nowait((loop.time() + delay, b""))
    await task


async def _proxy(listen: int, target: str, delay: float) -> None:
    host, port = target.rsplit(":", 1)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except OSError:  # the successor is not listening yet: the client will retry
            writer.close()
            return
        await asyncio.gather(_pump(reader, up_writer, delay), _pump(up_reader, writer, delay),
                             return_exceptions=True)

    server = await asyncio.start_server(handle, "127.0.0.1", listen)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


def model_ring(n: int, size: int, rate_bps: float, delay_s: float, piece: int,
               calls: int | None) -> float:
    """Seconds for one ring all-reduce (docs/performance.md, "Ring"): 2(n-1) steps of k pieces
    each go through one uplink, and a step's first piece can go only once the previous step's
    first piece is in, one hop (P/B + d) after it left, so a step takes at least that.
    Over gRPC (`calls` in flight) a piece's call takes P/B plus a round trip for its Ack, so a
    piece costs max(P/B, (P/B + 2d) / calls) and the last Ack comes 2d after the last piece
    left; on the data plane (`calls` None: one stream, no Acks) a piece costs P/B and the last
    one lands d after it left."""
    seg = size / n
    per_piece = min(piece, seg) / rate_bps
    if calls is None:
        effective, tail = per_piece, delay_s
    else:
        effective, tail = max(per_piece, (per_piece + 2 * delay_s) / calls), 2 * delay_s
    return 2 * (n - 1) * max(math.ceil(seg / piece) * effective, per_piece + delay_s) + tail


def model_send(size: int, rate_bps: float, delay_s: float) -> float:
    """Seconds for one Peer.send: the bytes through the link, then the Ack back."""
    return size / rate_bps + 2 * delay_s


def model_posts(frames: int, size: int, rate_bps: float, delay_s: float, calls: int) -> float:
    """Seconds for `frames` ordered Peer.posts of `size` bytes and the flush after them: each
    frame's call takes size/B plus a round trip, `calls` at once."""
    per = size / rate_bps
    return frames * max(per, (per + 2 * delay_s) / calls) + 2 * delay_s


def model_pipeline(stages: int, micro: int, compute_s: float, act_bytes: int, rate_bps: float,
                   delay_s: float, calls: int = CALLS, in_flight: int = 4,
                   ) -> tuple[float, float]:
    """(async, sync) seconds per microbatch of one cluster (docs/performance.md, "Pipeline"):
    every stage computes `compute_s` per microbatch (forward + backward); every hop carries
    `act_bytes` down and as much back, `calls` frames in flight at once per peer, each call
    waiting a round trip for its Ack; the root keeps at most `in_flight` microbatches in the
    pipeline (both schedules), so it also waits for a microbatch's round trip through every
    stage."""
    per = act_bytes / rate_bps
    hop = max(per, (per + 2 * delay_s) / calls)
    slowest = max(compute_s, hop) if stages > 1 else compute_s
    fill = (stages - 1) * (compute_s + 2 * (per + delay_s))
    window = (compute_s + fill) / in_flight
    return max(slowest, window), max((micro * slowest + fill) / micro, window)


def print_model() -> None:
    """The model's figures for internet links, for docs/performance.md."""
    mb = 1e6
    _emit("Ring all-reduce of S = 110 MB per member (a 440 MB model in 4 stages), P = 4 MiB, on "
          "the tcp data plane (the default), bf16 on it, and over gRPC with "
          f"{CALLS} calls in flight per peer; seconds")
    _emit(f"{'link':>16} " + " ".join(f"{f'n={n}':>8}" for n in (2, 4, 8, 16))
          + "  bf16 n=4  gRPC n=4")
    for rate in (10, 100, 1000):
        for delay in (20, 150):
            bps, d = rate * 1e6 / 8, delay / 1e3
            cells = [model_ring(n, int(110 * mb), bps, d, 4 << 20, None)
                     for n in (2, 4, 8, 16)]
            bf16 = model_ring(4, int(55 * mb), bps, d, 2 << 20, None)
            grpc = model_ring(4, int(110 * mb), bps, d, 4 << 20, CALLS)
            _emit(f"{rate:>5} Mbps {delay:>4} ms " + " ".join(f"{c:>8.1f}" for c in cells)
                  + f"  {bf16:>8.1f}  {grpc:>8.1f}")
    _emit()
    _emit("Pipeline of p stages, 50 ms of compute per stage and microbatch, 2 MB activations, "
          f"m = 8 microbatches, maxInFlight 4, {CALLS} calls in flight per peer; microbatches/s "
          "(async | sync)")
    _emit(f"{'link':>16} " + " ".join(f"{f'p={p}':>13}" for p in (1, 2, 4, 8)))
    for rate in (10, 100, 1000):
        for delay in (20, 150):
            bps, d = rate * 1e6 / 8, delay / 1e3
            cells = [model_pipeline(p, 8, 0.05, int(2 * mb), bps, d) for p in (1, 2, 4, 8)]
            _emit(f"{rate:>5} Mbps {delay:>4} ms " + " ".join(
                f"{1 / a:>6.1f} | {1 / s:>4.1f}" for a, s in cells))


# ---- rank processes (run inside a host's namespace) -------------------------------------------

def rank_main(args: argparse.Namespace) -> None:
    """One rank: serve, ring with the successor, print a JSON line of timings."""
    import torch

    from ravnest.comm.dataplane import RingLink, RingServer
    from ravnest.comm.framing import Frame
    from ravnest.comm.inboxes import Inbox
    from ravnest.comm.transport import Credentials, Peer, Server
    from ravnest.plan.plans import RingPlan
    from ravnest.train.allreducing import RingReducer

    torch.set_num_threads(1)
    n, rank = args.world, args.rank
    creds = Credentials(TOKEN, "bench-netem")
    inbox = Inbox()
    received: list[float] = []

    def deliver(frame: Frame) -> None:
        if frame.kind == "forward":
            received.append(time.perf_counter())
        else:
            inbox.deliver(frame)

    server = Server(f"{SUBNET}.{rank + 1}:{PORT}", creds, deliver)
    succ = (rank + 1) % n
    members = tuple(f"r{i}" for i in range(n))
    ring_server, link = None, None
    if args.ring_target:  # the data plane (training.ringTransport: tcp)
        ring_server = RingServer(f"{SUBNET}.{rank + 1}:{RING_PORT}", TOKEN, creds.fingerprint,
                                 inbox.deliver, inbox=inbox)
        ring_server.start()
        link = RingLink(args.ring_target, TOKEN, creds.fingerprint, members[rank],
                        compression=args.wire, timeout=600)
    server.start()  # after the ring server: a successor that answers health is listening there
    peer = Peer(args.target, creds, timeout=600, lanes=args.lane, compression=args.wire)
    peer.wait_ready(120)
    reducer = RingReducer(RingPlan(id="netem", members=members, state=()), members[rank],
                          {members[succ]: link or peer}, inbox, timeout=600,
                          piece_bytes=args.piece, compression=args.wire)
    t = torch.randn(args.size // 4, generator=torch.Generator().manual_seed(rank))
    expected = sum(torch.randn(args.size // 4, generator=torch.Generator().manual_seed(r))
                   for r in range(n)) / n
    ring: list[float] = []
    for round_ in range(args.rounds + 1):  # round 0 is the warmup
        work = t.clone()
        start = time.perf_counter()
        if not reducer.average([work], round_):
            raise SystemExit(f"rank {rank}: ring round {round_} skipped")
        if round_:
            ring.append(time.perf_counter() - start)
        err = (work - expected).abs().max().item()
        if err > (1e-5 if args.wire == "none" else 0.05):  # bf16: 8 bits of mantissa
            raise SystemExit(f"rank {rank}: ring result off by {err}")
    send: list[float] = []
    posts: list[float] = []
    if rank == 0:
        frame = Frame(kind="forward", tensors={"x": t})
        for i in range(args.rounds + 1):
            start = time.perf_counter()
            peer.send(frame, compression="none")
            if i:
                send.append(time.perf_counter() - start)
        act = t[:MIB // 2]  # 2 MiB of float32
        plain = (peer if args.wire == "none"
                 else Peer(args.target, creds, timeout=600, lanes=args.lane))
        for i in range(args.rounds + 1):
            start = time.perf_counter()
            for k in range(POSTS):
                plain.post(Frame(kind="forward", tensors={"x": act}, microbatch=k))
            plain.flush(600)
            if i:
                posts.append(time.perf_counter() - start)
        if plain is not peer:
            plain.close()
    # a last ring round keeps every rank serving until rank 0's sends are done
    if not reducer.average([t.clone()], args.rounds + 1):
        raise SystemExit(f"rank {rank}: closing round skipped")
    print(json.dumps({"rank": rank, "ring": ring, "send": send, "posts": posts}), flush=True)
    peer.close()
    if link is not None and ring_server is not None:
        link.close()
        ring_server.stop()
    server.stop(0)


def run_ranks(n: int, size: int, rounds: int, piece: int, lanes: int,
              delay_s: float, wire: str = "none",
              transport: str = "grpc") -> tuple[float, float, float]:
    """(median ring seconds over rounds of the slowest rank, median send seconds, median
    seconds of a burst of posts). With a delay, each rank reaches its successor through a delay
    line in its own namespace (one per port: gRPC, and the data plane's with tcp)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proxies: list[subprocess.Popen[str]] = []
    procs: list[subprocess.Popen[str]] = []

    def reach(rank: int, port: int, proxy_port: int) -> str:
        """How `rank` reaches its successor's `port`: directly, or through a delay line."""
        succ = f"{SUBNET}.{(rank + 1) % n + 1}:{port}"
        if delay_s <= 0:
            return succ
        proxy = subprocess.Popen(
            ["ip", "netns", "exec", f"{PREFIX}-h{rank}", sys.executable, __file__, "--proxy",
             str(proxy_port), succ, str(delay_s)], stdout=subprocess.PIPE, text=True, env=env)
        proxies.append(proxy)
        assert proxy.stdout is not None
        if proxy.stdout.readline().strip() != "ready":
            raise RuntimeError("delay line did not start")
        return f"127.0.0.1:{proxy_port}"

    try:
        for rank in range(n):
            cmd = ["ip", "netns", "exec", f"{PREFIX}-h{rank}", sys.executable, __file__,
                   "--rank", str(rank), "--world", str(n), "--size", str(size), "--rounds",
                   str(rounds), "--piece", str(piece), "--lane", str(lanes), "--target",
                   reach(rank, PORT, PROXY_PORT), "--wire", wire]
            if transport == "tcp":
                cmd += ["--ring-target", reach(rank, RING_PORT, RING_PROXY_PORT)]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, env=env))
        results = []
        for p in procs:
            out, err = p.communicate(timeout=900)
            if p.returncode != 0:
                raise RuntimeError(f"rank failed ({p.returncode}): {err[-2000:]}")
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs + proxies:
            if p.poll() is None:
                p.kill()
                p.wait()
    per_round = [max(r["ring"][i] for r in results) for i in range(rounds)]
    first = next(r for r in results if r["rank"] == 0)
    return (statistics.median(per_round), statistics.median(first["send"]),
            statistics.median(first["posts"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--delays", type=float, nargs="+", default=[0, 20, 50],
                        help="one-way delay per host uplink, ms")
    parser.add_argument("--rates", type=float, nargs="+", default=[100, 1000],
                        help="uplink rate, Mbit/s")
    parser.add_argument("--size", type=int, default=8, help="MiB of float32 per rank")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--piece", type=int, default=0,
                        help="ring piece bytes (default: the engine's PIECE_BYTES)")
    parser.add_argument("--lanes", type=int, nargs="+", default=None,
                        help="sender threads per peer for ring pieces (default: the engine's)")
    parser.add_argument("--wires", nargs="+", default=["none"], choices=["none", "bf16"],
                        help="ring compression: fp32 (none) and/or bf16 on the wire")
    parser.add_argument("--transports", nargs="+", default=["grpc"], choices=["grpc", "tcp"],
                        help="how ring pieces travel: gRPC calls and/or the tcp data plane")
    parser.add_argument("--wire", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--ring-target", default="", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--lane", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--proxy", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model-only", action="store_true",
                        help="print the model's figures for internet links and exit")
    args = parser.parse_args()
    if args.model_only:
        print_model()
        return
    if args.proxy:
        asyncio.run(_proxy(int(args.proxy[0]), args.proxy[1], float(args.proxy[2])))
        return
    if args.rank is not None:
        args.size = int(args.size)
        rank_main(args)
        return
    logging.basicConfig(level=logging.WARNING)
    if os.geteuid() != 0:
        raise SystemExit("bench/wan.py makes network namespaces: run it as root")
    from ravnest.comm.transport import UNORDERED_LANES
    from ravnest.train.allreducing import PIECE_BYTES

    piece = args.piece or PIECE_BYTES
    size = args.size * MIB
    _emit(f"Ring all-reduce and Peer.send between network namespaces, {args.size} MiB float32 "
          f"per rank, ring piece {piece / MIB:g} MiB; posts: {POSTS} ordered frames of 2 MiB; "
          f"median of {args.rounds}")
    _emit("model: docs/performance.md; ratio = measured / model")
    _emit(f"{'ranks':>5} {'delay':>6} {'rate':>9} {'ring':>4} {'lanes':>5} {'wire':>5} "
          f"{'ring ms':>9} "
          f"{'model ms':>9} "
          f"{'ratio':>6} {'send ms':>9} {'model ms':>9} {'ratio':>6} {'posts ms':>9} "
          f"{'model ms':>9} {'ratio':>6}")
    for n in args.ranks:
        with network(n):
            for rate in args.rates:
                for delay in args.delays:
                    shape_links([rate] * n)
                    # the lanes are gRPC's sender threads: the data plane's ring has one stream
                    cases = [(t, lanes, wire) for t in args.transports
                             for lanes in (args.lanes or [UNORDERED_LANES]
                                           if t == "grpc" else [UNORDERED_LANES])
                             for wire in args.wires]
                    for transport, lanes, wire in cases:
                        ring_s, send_s, posts_s = run_ranks(n, size, args.rounds, piece, lanes,
                                                            delay / 1e3, wire, transport)
                        bps, d = rate * 1e6 / 8, delay / 1e3
                        # bf16 halves the ring's bytes (its pieces too); Peer.send stays fp32
                        half = 2 if wire == "bf16" else 1
                        ring_m = model_ring(n, size // half, bps, d, piece // half,
                                            lanes + 1 if transport == "grpc" else None)
                        send_m = model_send(size, bps, d)
                        posts_m = model_posts(POSTS, 2 * MIB, bps, d, lanes + 1)
                        _emit(f"{n:>5} {delay:>4.0f}ms {rate:>5.0f}Mbps {transport:>4} "
                              f"{lanes if transport == 'grpc' else '-':>5} "
                              f"{'fp32' if wire == 'none' else wire:>5} "
                              f"{ring_s * 1e3:>9.0f} {ring_m * 1e3:>9.0f} {ring_s / ring_m:>6.2f} "
                              f"{send_s * 1e3:>9.0f} {send_m * 1e3:>9.0f} {send_s / send_m:>6.2f} "
                              f"{posts_s * 1e3:>9.0f} {posts_m * 1e3:>9.0f} "
                              f"{posts_s / posts_m:>6.2f}")

if __name__ == "__main__":
    main()
