"""Worker memory: peak RSS against what a stage must hold, and bounded in-flight microbatches.

Why it exists: a provider is picked for its RAM, so a worker must not need much more than its
stage's parameters, gradients, optimizer state, the weight stash (async) and the activations of
the microbatches in flight, plus a fixed runtime overhead; and a slow downstream stage must not
make its upstream pile up activations (backpressure).

Three spawned processes run a 3-stage pipeline through the real worker path (`NodeRuntime`,
`Server`, `Inbox`, `Peer`s on 127.0.0.1, Adam), as in bench/pipeline.py. For each node:

- overhead: the RSS of the process with torch, grpc and ravnest imported, its gRPC server up and
  its peers connected, before its stage is built (an idle worker with an empty stage);
- expected: parameters + gradients + optimizer state (measured from the optimizer) + the async
  weight stash + in-flight activations, i.e. the stage's layer outputs for one microbatch (what
  autograd keeps) times the most microbatches the node held at once (sampled);
- peak: the process's peak RSS over its whole life (`ru_maxrss`; it includes building the
  whole model once before cutting the stage out), and the peak sampled every 5 ms while training;
- ratio: peak / (overhead + expected); the target is <= 1.5.

Two runs: `params` (wide Linear layers, few rows: parameters and Adam state dominate; async, so
the stash counts) and `activations` (narrow layers, many rows: activations dominate) whose leaf
sleeps per microbatch, so the root and stem run far ahead of it unless something bounds them.
For that run the RSS of every node over the steady part (after the first quarter) is printed:
flat (growth of a few MB) means in-flight microbatches are bounded (`maxInFlight` at the root,
the Inbox capacity and the Ack of each frame behind it).

    python bench/memory.py [--slow-ms 150] [--in-flight 4] [-v]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from pipeline import NodeReport, RunConfig, StageCost, run_nodes

MB = 1e6


def _emit(line: str = "") -> None:
    print(line, flush=True)


def _expected(r: NodeReport) -> int:
    return (r.param_bytes + r.grad_bytes + r.optimizer_bytes + r.stash_bytes + r.data_bytes
            + r.activation_bytes_per_mb * r.max_pending)


def _report(name: str, reports: dict[str, NodeReport]) -> None:
    _emit(f"run {name}")
    _emit(f"{'node':<7} {'params':>6} {'grads':>6} {'optim':>6} {'stash':>6} {'data':>6} "
          f"{'act/mb':>6} {'held':>4} {'expect':>6} | {'overhd':>6} {'peak':>6} {'ratio':>5} | "
          f"{'anon oh':>7} {'anon pk':>7} {'ratio':>5}")
    for node, r in sorted(reports.items()):
        exp = _expected(r)
        anon_peak = max((a for _, _, a in r.rss_samples), default=0)
        _emit(f"{node:<7} {r.param_bytes / MB:>6.1f} {r.grad_bytes / MB:>6.1f} "
              f"{r.optimizer_bytes / MB:>6.1f} {r.stash_bytes / MB:>6.1f} "
              f"{r.data_bytes / MB:>6.1f} {r.activation_bytes_per_mb / MB:>6.1f} "
              f"{r.max_pending:>4} {exp / MB:>6.1f} | {r.rss_base / MB:>6.1f} "
              f"{r.peak_rss / MB:>6.1f} {r.peak_rss / (r.rss_base + exp):>5.2f} | "
              f"{r.anon_base / MB:>7.1f} {anon_peak / MB:>7.1f} "
              f"{anon_peak / (r.anon_base + exp):>5.2f}")


def _flatness(reports: dict[str, NodeReport]) -> None:
    _emit(f"{'node':<7} {'rss at 25%':>10} {'50%':>7} {'75%':>7} {'90%':>7} {'drift':>6} "
          f"{'band':>6} {'max held':>8} {'max inbox':>9}")
    for node, r in sorted(reports.items()):
        s = [v for _, v, _ in r.rss_samples]
        if len(s) < 8:
            _emit(f"{node:<7} (too few samples)")
            continue
        q = [s[int(len(s) * f)] for f in (0.25, 0.5, 0.75, 0.9)]
        steady = s[len(s) // 4:int(len(s) * 0.9) + 1]
        _emit(f"{node:<7} {q[0] / MB:>10.1f} {q[1] / MB:>7.1f} {q[2] / MB:>7.1f} "
              f"{q[3] / MB:>7.1f} {(q[3] - q[0]) / MB:>6.1f} "
              f"{(max(steady) - min(steady)) / MB:>6.1f} {r.max_pending:>8} {r.max_inbox:>9}")
    _emit("(MB; drift: RSS at 90% of the run - at 25%; band: max - min between them; the last "
          "10% is validation and shutdown)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slow-ms", type=float, default=150.0,
                        help="leaf forward sleep per microbatch in the activations run")
    parser.add_argument("--in-flight", type=int, default=4, help="maxInFlight")
    parser.add_argument("--updates", type=int, default=12,
                        help="updates of 4 microbatches in the activations run")
    parser.add_argument("--repeats", type=int, default=1, help="ignored (one run each)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed updates per run")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    wide = tuple(StageCost(0.0, 0.0, layers=3, width=2048) for _ in range(3))
    narrow = (StageCost(0.0, 0.0, layers=3, width=128), StageCost(0.0, 0.0, layers=3, width=128),
              StageCost(args.slow_ms / 1000, 0.0, layers=3, width=128))
    runs = [
        ("params (3 x Linear 2048x2048 per stage, 8 rows, async, Adam)",
         RunConfig("params", "async", 4, 4, args.warmup, wide, mb_rows=8,
                   max_in_flight=args.in_flight, sample_memory=True)),
        (f"activations (3 x Linear 128x128 per stage, 8192 rows, async, Adam, leaf sleeps "
         f"{args.slow_ms:g} ms per microbatch)",
         RunConfig("activations", "async", 4, args.updates, args.warmup, narrow, mb_rows=8192,
                   max_in_flight=args.in_flight, sample_memory=True)),
    ]
    load = os.getloadavg()
    _emit(f"Worker memory, 3 stages in 3 processes, real gRPC on 127.0.0.1, maxInFlight "
          f"{args.in_flight}; MB = 10^6 bytes; load average {load[0]:.1f}")
    started = time.monotonic()
    results = {}
    for title, cfg in runs:
        results[cfg.name] = run_nodes([cfg], 3, args.verbose)[0]
        _emit()
        _report(title, results[cfg.name])
    _emit()
    _emit("activations run: RSS while the leaf is the bottleneck")
    _flatness(results["activations"])
    _emit()
    _emit("expect = params + grads (x2 in async: the stash's) + optim + stash (x weight versions "
          "alive at once) + data (root) + act/mb x held (most microbatches held at once)")
    _emit("ratio = peak / (overhd + expect): peak = ru_maxrss over the process's life; anon: "
          "the same without file-backed pages (shared libraries), peak sampled while training")
    _emit(f"({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
