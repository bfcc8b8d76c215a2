"""Point-to-point throughput: one tensor through our transport versus a bare gRPC byte stream and
torch.distributed gloo send/recv.

Why it exists: every activation, gradient and ring piece travels as a `Frame` through
`Peer.send` -> `Server`. This measures what that costs against the ceiling of Python gRPC on the
same loopback in the same run: a client-streaming call of plain `bytes` in 1 MiB chunks with no
protobuf (generic handlers, no serializers), whose server only counts the bytes.

The servers live in a separate process (spawn), so client and server do not share a GIL; the
same two processes also form a gloo group, and gloo's figure is `dist.send` of the tensor to the
server process, which `dist.recv`s it into a preallocated tensor (then one small ack back).
A fourth variant, "fresh", sends to a second Server of ours with receive-buffer reuse off
(`reuse_bytes=0`), so every frame lands in a newly allocated buffer: what the reuse is worth.
The four are taken in turn, repeat by repeat, after a warmup; the median is printed.
A second table times the stages of our path in one process (encode_wire: tensors straight into
serialized Chunk messages; decode_wire: messages into the frame's buffer) next to the protobuf
object path they replaced, to show where the difference goes.

    python bench/transfer.py [--sizes 1 16 64] [--repeats 5] [--warmup 1] [--csv rows.csv]
                             [--glibc-heap]

`--csv` writes one row per size (bytes and the three medians in seconds) for bench/plot.py.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import logging
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import torch
import torch.distributed as dist

from ravnest.comm.buffers import BufferPool
from ravnest.comm.framing import (
    CHUNK_BYTES,
    Frame,
    decode_wire,
    encode_wire,
)
from ravnest.comm.proto import ravnest_pb2 as pb
from ravnest.comm.transport import Credentials, Peer, Server
from ravnest.train import heap

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the protobuf path:
from framing_helpers import decode, encode  # tests/framing_helpers.py

log = logging.getLogger("bench.transfer")

MIB = 1 << 20
RAW_METHOD = "/bench.Raw/Sink"
CREDS = Credentials(token="bench-token", fingerprint="bench-plan")
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 2 * CHUNK_BYTES),
    ("grpc.max_receive_message_length", 2 * CHUNK_BYTES),
]
MIN_BYTES_PER_REPEAT = 32 * MIB
"""Small tensors are sent several times per repeat so that one repeat moves at least this much."""


def _emit(line: str = "") -> None:
    print(line, flush=True)


def _raw_sink(request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
    n = 0
    for chunk in request_iterator:
        n += len(chunk)
    return n.to_bytes(8, "little")


def _serve(ports: Any, stop: Any, gloo_port: int, gloo_jobs: Any, tune_heap: bool) -> None:
    """Server process: our Server (deliver counts frames), a raw bytes sink, and gloo rank 1
    that receives what each job (numel, times) says, until stopped."""
    if tune_heap:
        heap.tune(os.environ)
    received = {"frames": 0, "bytes": 0}

    def deliver(frame: Frame) -> None:
        received["frames"] += 1
        received["bytes"] += frame.nbytes()

    ours = Server("127.0.0.1:0", CREDS, deliver)
    fresh = Server("127.0.0.1:0", CREDS, deliver, reuse_bytes=0)
    raw = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=GRPC_OPTIONS)
    raw.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "bench.Raw", {"Sink": grpc.stream_unary_rpc_method_handler(_raw_sink)}),))
    raw_port = raw.add_insecure_port("127.0.0.1:0")
    ours.start()
    fresh.start()
    raw.start()
    ports.put((ours.port, fresh.port, raw_port))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=1,
                            world_size=2, timeout=datetime.timedelta(seconds=600))
    ack = torch.zeros(1)
    while (job := gloo_jobs.get()) is not None:
        numel, times = job
        into = torch.empty(numel)
        for _ in range(times):
            dist.recv(into, 0)
        dist.send(ack, 0)
    dist.destroy_process_group()
    stop.wait()
    raw.stop(0).wait()
    ours.stop(0)
    fresh.stop(0)


def _raw_chunks(t: torch.Tensor) -> Iterator[bytes]:
    data = t.reshape(-1).view(torch.uint8).numpy()
    for start in range(0, len(data), CHUNK_BYTES):
        yield data[start:start + CHUNK_BYTES].tobytes()


def _size(n: int) -> str:
    return f"{n / MIB:g}MiB" if n >= MIB else f"{n / 1024:g}KiB"


def _timed(fn: Callable[[], None], times: int) -> float:
    start = time.perf_counter()
    for _ in range(times):
        fn()
    return (time.perf_counter() - start) / times


def _measure(sizes: list[int], repeats: int, warmup: int,
             tune_heap: bool = True) -> list[tuple[int, float, float, float, float]]:
    ctx = mp.get_context("spawn")
    ports, stop, gloo_jobs = ctx.Queue(), ctx.Event(), ctx.Queue()
    gloo_port = _free_port()
    server = ctx.Process(target=_serve, args=(ports, stop, gloo_port, gloo_jobs, tune_heap),
                         name="bench-server")
    server.start()
    try:
        our_port, fresh_port, raw_port = ports.get(timeout=120)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=0,
                                world_size=2, timeout=datetime.timedelta(seconds=600))
        peer = Peer(f"127.0.0.1:{our_port}", CREDS)
        peer.wait_ready(60)
        fresh_peer = Peer(f"127.0.0.1:{fresh_port}", CREDS)
        fresh_peer.wait_ready(60)
        channel = grpc.insecure_channel(f"127.0.0.1:{raw_port}", options=GRPC_OPTIONS)
        sink = channel.stream_unary(RAW_METHOD)
        ack = torch.zeros(1)
        rows: list[tuple[int, float, float, float, float]] = []
        for size in sizes:
            t = torch.randn(size // 4)
            times = max(1, MIN_BYTES_PER_REPEAT // size)
            frame = Frame(kind="forward", tensors={"x": t})

            def ours(frame: Frame = frame, times: int = times) -> float:
                return _timed(lambda: peer.send(frame), times)

            def fresh(frame: Frame = frame, times: int = times) -> float:
                return _timed(lambda: fresh_peer.send(frame), times)

            def raw(t: torch.Tensor = t, times: int = times) -> float:
                def once() -> None:
                    got = int.from_bytes(sink(_raw_chunks(t), wait_for_ready=True), "little")
                    if got != t.numel() * 4:
                        raise RuntimeError(f"raw sink got {got} bytes, sent {t.numel() * 4}")
                return _timed(once, times)

            def gloo(t: torch.Tensor = t, times: int = times) -> float:
                gloo_jobs.put((t.numel(), times))
                start = time.perf_counter()
                for _ in range(times):
                    dist.send(t, 1)
                dist.recv(ack, 1)
                return (time.perf_counter() - start) / times

            samples: dict[str, list[float]] = {"ours": [], "fresh": [], "raw": [], "gloo": []}
            variants: list[tuple[str, Callable[[], float]]] = [
                ("ours", ours), ("fresh", fresh), ("raw", raw), ("gloo", gloo)]
            for i in range(warmup + repeats):
                for name, fn in variants if i % 2 == 0 else reversed(variants):
                    seconds = fn()
                    if i >= warmup:
                        samples[name].append(seconds)
            log.info("%d bytes: %s", size, samples)
            rows.append((size, *(statistics.median(samples[k])
                                 for k in ("ours", "raw", "gloo", "fresh"))))
        peer.close()
        fresh_peer.close()
        channel.close()
        gloo_jobs.put(None)
        dist.destroy_process_group()
        return rows
    finally:
        stop.set()
        server.join(timeout=30)
        if server.is_alive():
            server.terminate()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stages(size: int, repeats: int) -> list[tuple[str, float]]:
    """Median seconds of each step of our path, in one process, for one tensor of `size` bytes."""
    t = torch.randn(size // 4)
    frame = Frame(kind="forward", tensors={"x": t})
    chunks = list(encode(frame))
    blobs = [c.SerializeToString() for c in chunks]
    parsed = [pb.Chunk.FromString(b) for b in blobs]
    messages = encode_wire(frame)
    pool = BufferPool()
    dst = torch.empty_like(t)
    steps: list[tuple[str, Callable[[], object]]] = [
        ("memcpy (tensor.copy_)", lambda: dst.copy_(t)),
        ("raw: tensor -> 1 MiB bytes chunks", lambda: list(_raw_chunks(t))),
        ("ours: encode_wire (tensor -> messages)", lambda: encode_wire(frame)),
        ("ours: decode_wire (messages -> new tensor)", lambda: decode_wire(iter(messages))),
        ("ours: decode_wire into a reused buffer", lambda: decode_wire(iter(messages), pool=pool)),
        ("protobuf path: encode (tensor -> pb.Chunk)", lambda: list(encode(frame))),
        ("protobuf path: SerializeToString", lambda: [c.SerializeToString() for c in chunks]),
        ("protobuf path: FromString", lambda: [pb.Chunk.FromString(b) for b in blobs]),
        ("protobuf path: decode (pb.Chunk -> tensor)", lambda: decode(iter(parsed))),
    ]
    out = []
    for name, fn in steps:
        fn()
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        out.append((name, statistics.median(samples)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 16, 64],
                        help="tensor sizes in MiB (float32), e.g. 0.0625 for 64 KiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--csv", help="also write the rows to this CSV file (for bench/plot.py)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every repeat")
    parser.add_argument("--glibc-heap", action="store_true",
                        help="leave glibc's heap thresholds as they are (as workers did before "
                             "ravnest.train.heap.tune); by default both processes tune them as "
                             "workers do")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    tuned = not args.glibc_heap and heap.tune(os.environ)

    rows = _measure([int(s * MIB) // 4 * 4 for s in args.sizes], args.repeats, args.warmup,
                    tune_heap=not args.glibc_heap)
    _emit(f"Point-to-point, 127.0.0.1, server in another process; median of {args.repeats} "
          f"(GB = 1e9 bytes); heap: {'tuned as a worker' if tuned else 'glibc as it is'}")
    _emit(f"{'size':>9} {'ours ms':>9} {'raw ms':>9} {'gloo ms':>9} {'ours GB/s':>10} "
          f"{'raw GB/s':>9} {'gloo GB/s':>10} {'ours/raw':>9} {'ours/gloo':>10} "
          f"{'fresh/raw':>10}")
    for size, ours_s, raw_s, gloo_s, fresh_s in rows:
        _emit(f"{_size(size):>9} {ours_s * 1e3:>9.2f} {raw_s * 1e3:>9.2f} {gloo_s * 1e3:>9.2f} "
              f"{size / ours_s / 1e9:>10.3f} {size / raw_s / 1e9:>9.3f} "
              f"{size / gloo_s / 1e9:>10.3f} {raw_s / ours_s:>9.2f} {gloo_s / ours_s:>10.2f} "
              f"{raw_s / fresh_s:>10.2f}")
    _emit("fresh: our Server with receive-buffer reuse off (reuse_bytes=0): every frame "
          "lands in a newly allocated buffer")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["bytes", "ours_s", "raw_s", "gloo_s"])
            writer.writerows(row[:4] for row in rows)

    size = int(max(args.sizes) * MIB) // 4 * 4
    _emit()
    _emit(f"Where our time goes: each step alone, one process, {_size(size)}; "
          f"median of {args.repeats}")
    _emit(f"{'step':<44} {'ms':>8} {'GB/s':>8}")
    for name, seconds in _stages(size, args.repeats):
        _emit(f"{name:<44} {seconds * 1e3:>8.1f} {size / seconds / 1e9:>8.2f}")


if __name__ == "__main__":
    main()
