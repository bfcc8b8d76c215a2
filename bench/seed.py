"""The seed API against `ravnest run`: the digits CNN, 1 cluster x 3 stages, side by side.

Why it exists: Ravnest's original Python API (`clusterize`, `Node`, `Trainer` in
`ravnest.seed`) and the job path (`ravnest run job.yaml`) drive the same runtime, but each adds
its own start-up, data feeding and finishing work. This times both on the same model, data,
hyper-parameters and layout, in one run, the variants alternating repeat by repeat:

- **seed**: in a temporary folder, `node_data/node_configs.json` names 3 providers with equal RAM
  on free 127.0.0.1 ports; `clusterize(..., clusters=1)` runs in this process, then 3 provider
  scripts (written into the folder, in the seeds' walkthrough style: `Node(name=..., optimizer=
  torch.optim.Adam, ...)`, `Trainer(...)`, `trainer.train()`) run as separate processes. The root
  prints how long its `trainer.train()` took and how many samples it trained
  (`trainer.runtime.samples`); the bench times until all 3 processes have exited.
- **run**: the equivalent RavnestJob (`ravnest.examples.digits` entrypoints as in
  `examples/digits.yaml`, 3 providers with equal RAM, `plan.clusters: 1`) run as
  `python -m ravnest.cli run job.yaml` in a subprocess; `summary.json` gives the samples trained
  and the seconds from the workers' launch to the last one's exit.

Both: batch size 64, 1 microbatch, Adam lr 0.003 with StepLR(step_size 4, gamma 0.5) stepped per
epoch and cross-entropy (as `examples/digits.yaml`), `--epochs` epochs (default 10), validation
once per epoch on the validation split. The bench checks that both plans have the same layout
(nodes, roles, first and last layer of every stage).

Figures per path (median over `--repeats`):

- `train s`: seed: the root's `trainer.train()` (it includes waiting for its peers to be up);
  run: not measured by `ravnest run`, so taken from the root's learning curve (below);
- `curve s`: both: the root's learning curve from its first row to its last (validation after the
  last epoch) plus one mean update for the first, which has no row before it: the training loop
  alone, the like-for-like figure;
- `samples/s`: samples trained / `train s`;
- `exited s`: from starting the provider / worker processes to the last one's exit (run: summary
  `seconds`);
- `wall s`: seed: clusterize + providers; run: the whole `ravnest run` subprocess (planning,
  workers, fusing and evaluating the model).

    python bench/seed.py [--epochs 10] [--repeats 1] [--seed-threads 0 1] [--drop-last]
                         [--timeout 900] [-v]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger("bench.seed")

ROOT = Path(__file__).resolve().parents[1]
BATCH = 64
LR = 0.003
STEP_LR = {"step_size": 4, "gamma": 0.5}
RAM_GB = 4
BANDWIDTH = 100
PROVIDERS = 3
RESULT = "SEED_BENCH_RESULT "

PROVIDER_SCRIPT = textwrap.dedent('''\
    """A seed bench provider, in the seeds' walkthrough style: `python provider.py node_0`."""
    import json
    import sys
    import time

    import torch
    from torch.utils.data import DataLoader

    from ravnest import Node, Trainer, set_seed
    from ravnest.examples.digits import datasets

    EPOCHS, BATCH, LR, STEP_LR = {epochs}, {batch}, {lr}, {step_lr}
    set_seed(42)


    def preprocess_dataset():
        train, val = datasets()
        generator = torch.Generator().manual_seed(42)
        train_loader = DataLoader(train, batch_size=BATCH, shuffle=True, generator=generator,
                                  drop_last={drop_last})
        val_loader = DataLoader(val, batch_size=BATCH, drop_last={drop_last})
        return train_loader, val_loader


    def loss_fn(predictions, targets):
        # the whole (X, y) batch of `labels`, or y alone, depending on the runtime's version
        y = targets[1] if isinstance(targets, (tuple, list)) else targets
        return torch.nn.functional.cross_entropy(predictions, y)


    if __name__ == "__main__":
        train_loader, val_loader = preprocess_dataset()
        node = Node(name=sys.argv[1], optimizer=torch.optim.Adam, optimizer_params={{"lr": LR}},
                    lr_scheduler=torch.optim.lr_scheduler.StepLR, lr_scheduler_params=STEP_LR,
                    criterion=loss_fn, labels=train_loader, test_labels=val_loader,
                    listen_host="127.0.0.1")
        trainer = Trainer(node=node, train_loader=train_loader, val_loader=val_loader,
                          epochs=EPOCHS, batch_size=BATCH, save=True)
        started = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - started
        if node.me.is_root:
            rt = trainer.runtime
            samples = getattr(rt, "samples", None)
            estimated = samples is None
            if estimated:
                used = min(len(train_loader), len(train_loader.dataset) // BATCH)
                samples = EPOCHS * used * BATCH
            rows = [dict(r) for r in getattr(getattr(rt, "curve", None), "rows", [])]
            print("{marker}" + json.dumps({{
                "train_seconds": seconds, "samples": samples, "estimated": estimated,
                "accuracy": trainer.evaluate(), "threads": torch.get_num_threads(),
                "curve": [{{k: v for k, v in r.items() if isinstance(v, (int, float))}}
                          for r in rows]}}), flush=True)
''')


def _emit(line: str = "") -> None:
    print(line, flush=True)


def _env() -> dict[str, str]:
    """This environment, with the checkout's worker/ and operator/ on PYTHONPATH after what it
    already holds (so PYTHONPATH=/elsewhere/worker times another tree)."""
    paths = [str(ROOT / "worker"), str(ROOT / "operator")]
    extra = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(([extra] if extra else []) + paths)}


def _layout(plan: Any) -> list[tuple[Any, ...]]:
    return [(n.name, n.cluster, n.stage, n.role, n.first_layer, n.last_layer)
            for n in plan.nodes]


def _curve_seconds(rows: list[dict[str, Any]]) -> float | None:
    """Seconds of the training loop from the root's learning curve: first row to last, plus one
    mean update for the first update (which ends at the first row)."""
    stamped = [r for r in rows if "time" in r]
    steps = [r for r in stamped if "train_loss" in r]
    if len(stamped) < 2 or len(steps) < 2:
        return None
    per_update = (steps[-1]["time"] - steps[0]["time"]) / (steps[-1]["step"] - steps[0]["step"])
    return stamped[-1]["time"] - stamped[0]["time"] + per_update


def _kill_group(p: subprocess.Popen[Any], sig: int = signal.SIGKILL) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return f"({path}: nothing written)"


def run_seed(epochs: int, threads: int | None, drop_last: bool, timeout: float,
             verbose: bool) -> dict[str, Any]:
    import torch

    from ravnest import clusterize, set_seed
    from ravnest.examples.digits import build_model
    from ravnest.run.local import free_ports

    with tempfile.TemporaryDirectory(prefix="ravnest-seed-bench-") as tmp:
        folder = Path(tmp)
        (folder / "provider.py").write_text(PROVIDER_SCRIPT.format(
            epochs=epochs, batch=BATCH, lr=LR, step_lr=repr(STEP_LR), drop_last=drop_last,
            marker=RESULT))
        ports = free_ports(PROVIDERS)
        (folder / "node_data").mkdir()
        (folder / "node_data" / "node_configs.json").write_text(json.dumps({
            str(i): {"IP": f"127.0.0.1:{p}", "benchmarks": {"ram": RAM_GB, "bandwidth": BANDWIDTH}}
            for i, p in enumerate(ports)}, indent=1))
        began = time.monotonic()
        set_seed(42)
        # clusterize may print its plan table: keep stdout for this bench's table
        with contextlib.redirect_stdout(sys.stderr if verbose else io.StringIO()):
            plan = clusterize(model=build_model(), example_args=(torch.rand(BATCH, 1, 8, 8),),
                              node_data=folder / "node_data", clusters=1, batch_size=BATCH)
        planned = time.monotonic() - began
        root = plan.clusters[0].nodes[0]
        env = _env()
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        logs = {n.name: folder / f"{n.name}.log" for n in plan.nodes}
        procs: dict[str, subprocess.Popen[Any]] = {}
        launched = time.monotonic()
        exited: dict[str, float] = {}
        try:
            for name, logfile in logs.items():
                with open(logfile, "wb") as fh:
                    procs[name] = subprocess.Popen(
                        [sys.executable, "provider.py", name], cwd=folder, env=env, stdout=fh,
                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                        start_new_session=True)
            while len(exited) < len(procs):
                for name, p in procs.items():
                    if name not in exited and p.poll() is not None:
                        exited[name] = time.monotonic() - launched
                        if p.returncode != 0:
                            raise RuntimeError(f"seed provider {name} exited with "
                                               f"{p.returncode}:\n{_tail(logs[name])}")
                if time.monotonic() - launched > timeout:
                    raise RuntimeError(f"seed path still running after {timeout:.0f} s; root "
                                       f"log:\n{_tail(logs[root])}")
                time.sleep(0.05)
        finally:
            for p in procs.values():
                _kill_group(p)
                p.wait()
        all_exited = max(exited.values())
        wall = time.monotonic() - began
        out = logs[root].read_text(errors="replace")
        lines = [ln for ln in out.splitlines() if ln.startswith(RESULT)]
        if not lines:
            raise RuntimeError(f"the seed root {root} printed no result:\n{_tail(logs[root])}")
        r = json.loads(lines[-1][len(RESULT):])
    result = {"train": r["train_seconds"], "curve": _curve_seconds(r["curve"]),
              "samples": r["samples"], "estimated": r["estimated"], "exited": all_exited,
              "wall": wall, "planned": planned, "accuracy": r["accuracy"],
              "threads": r["threads"], "layout": _layout(plan)}
    if verbose:
        log.info("seed: clusterize %.2f s, train() %.2f s, curve %.2f s, %d samples%s, all "
                 "exited %.2f s (%s), wall %.2f s, accuracy %s, torch threads %s", planned,
                 result["train"], result["curve"] or float("nan"), result["samples"],
                 " (estimated)" if result["estimated"] else "", all_exited,
                 ", ".join(f"{k} {v:.1f}" for k, v in sorted(exited.items())), wall,
                 result["accuracy"], result["threads"])
    return result


def job_document(epochs: int) -> dict[str, Any]:
    """examples/digits.yaml's entrypoints and optimizer, on the seed path's layout and batch."""
    return {
        "apiVersion": "ravnest.io/v1alpha1", "kind": "RavnestJob",
        "metadata": {"name": "digits-seed-bench"},
        "spec": {
            "model": {"entrypoint": "ravnest.examples.digits:build_model",
                      "exampleInput": {"shape": [BATCH, 1, 8, 8], "dtype": "float32"}},
            "data": {"entrypoint": "ravnest.examples.digits:datasets", "batchSize": BATCH,
                     "microbatches": 1, "seed": 42},
            "training": {"epochs": epochs,
                         "optimizer": {"name": "Adam", "params": {"lr": LR}},
                         "lrScheduler": {"name": "StepLR", "params": dict(STEP_LR)},
                         "criterion": {"name": "CrossEntropyLoss"},
                         "validationFrequency": 1},
            "plan": {"clusters": 1},
            "providers": [{"ram": RAM_GB, "bandwidth": BANDWIDTH, "replicas": PROVIDERS}],
        },
    }


def run_job(epochs: int, timeout: float, verbose: bool) -> dict[str, Any]:
    from ravnest.run.metadata import NodeMetadata

    with tempfile.TemporaryDirectory(prefix="ravnest-run-bench-") as tmp:
        folder = Path(tmp)
        (folder / "job.yaml").write_text(yaml.safe_dump(job_document(epochs), sort_keys=False))
        out = folder / "out"
        began = time.monotonic()
        with open(folder / "run.log", "wb") as fh:
            p = subprocess.Popen(
                [sys.executable, "-m", "ravnest.cli", "run", "job.yaml", "-o", str(out),
                 "--no-progress"], cwd=folder, env=_env(), stdout=fh, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            _kill_group(p, signal.SIGTERM)  # `ravnest run` stops its workers on SIGTERM
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
            raise RuntimeError(f"`ravnest run` still running after {timeout:.0f} s:\n"
                               f"{_tail(folder / 'run.log')}") from None
        finally:
            _kill_group(p)
            p.wait()
        wall = time.monotonic() - began
        if p.returncode != 0:
            raise RuntimeError(f"`ravnest run` exited with {p.returncode}:\n"
                               f"{_tail(folder / 'run.log')}")
        summary = json.loads((out / "summary.json").read_text())
        cluster = json.loads((out / "clusters" / "cluster_0.json").read_text())
        plan = NodeMetadata.load(out / "nodes" / "node_0.json").plan
        curve = _curve_seconds(cluster["curve"])
    result = {"train": curve, "curve": curve, "samples": summary["samples_trained"],
              "estimated": False, "exited": summary["seconds"], "wall": wall,
              "summary_rate": summary["samples_per_second"],
              "accuracy": summary["val_metric"], "threads": 1, "layout": _layout(plan)}
    if verbose:
        log.info("run: curve %.2f s, %d samples, summary %.2f s (%s samples/s), wall %.2f s, "
                 "accuracy %s", curve or float("nan"), result["samples"], summary["seconds"],
                 summary["samples_per_second"], wall, summary["val_metric"])
    return result


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _fmt(v: float | None, width: int, digits: int = 2) -> str:
    return f"{v:>{width}.{digits}f}" if v is not None else f"{'-':>{width}}"


def _seed_name(threads: int) -> str:
    return "seed" if not threads else f"seed t={threads}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=0, help="ignored (runs are whole jobs)")
    parser.add_argument("--seed-threads", type=int, nargs="+", default=[0, 1],
                        help="one seed variant per value: OMP_NUM_THREADS of its providers, 0 "
                             "for torch's own default (`ravnest run` gives each worker 1)")
    parser.add_argument("--drop-last", action="store_true",
                        help="drop_last=True in the seed providers' DataLoaders")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    logging.getLogger("ravnest").setLevel(logging.WARNING)  # clusterize's plan table: see layout
    sys.path.extend([str(ROOT / "worker"), str(ROOT / "operator")])
    _emit(f"Seed API vs `ravnest run`: digits CNN, 1 cluster x {PROVIDERS} providers "
          f"({RAM_GB} GB each), batch {BATCH}, Adam lr {LR}, {args.epochs} epoch(s); median of "
          f"{args.repeats} run(s), variants alternating; load average "
          f"{os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs")
    started = time.monotonic()
    seeds = {_seed_name(t): t for t in dict.fromkeys(args.seed_threads)}
    variants = [*seeds, "run"]
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for i in range(args.repeats):
        k = i % len(variants)
        for path in variants[k:] + variants[:k]:  # rotate, so no variant always runs first
            if path == "run":
                r = run_job(args.epochs, args.timeout, args.verbose)
            else:
                r = run_seed(args.epochs, seeds[path] or None, args.drop_last, args.timeout,
                             args.verbose)
            runs[path].append(r)
            log.info("repeat %d %s: train %.2f s, exited %.2f s, wall %.2f s", i + 1, path,
                     r["train"] or float("nan"), r["exited"], r["wall"])
    run_layout = runs["run"][-1]["layout"]
    seed_layouts = [runs[v][-1]["layout"] for v in seeds]
    _emit("layout: " + "; ".join(f"{n} {role} {first}..{last}"
                                 for n, _, _, role, first, last in run_layout)
          + (" (the same in both paths)" if all(sl == run_layout for sl in seed_layouts)
             else f"  DIFFERS in the seed path: {seed_layouts}"))
    if any(r["estimated"] for v in seeds for r in runs[v]):
        _emit("(seed samples estimated: trainer.runtime has no `samples`)")
    if args.drop_last:
        _emit("(seed DataLoaders with drop_last=True)")
    _emit()
    cols = ("train s", "curve s", "samples/s", "exited s", "wall s")
    _emit(f"{'path':<10} " + " ".join(f"{c:>10}" for c in cols) + f" {'accuracy':>9} "
          f"{'samples':>8} {'threads':>7}  runs (train s)")
    med: dict[str, dict[str, float | None]] = {}
    for path, rs in runs.items():
        m = {"train s": _median([r["train"] for r in rs]),
             "curve s": _median([r["curve"] for r in rs]),
             "samples/s": _median([r["samples"] / r["train"] if r["train"] else None
                                   for r in rs]),
             "exited s": _median([r["exited"] for r in rs]),
             "wall s": _median([r["wall"] for r in rs])}
        med[path] = m
        _emit(f"{path:<10} " + " ".join(_fmt(m[c], 10, 1 if c == "samples/s" else 2)
                                        for c in cols)
              + f" {_fmt(_median([r['accuracy'] for r in rs]), 9, 4)} "
              f"{rs[-1]['samples']:>8} {rs[-1]['threads']:>7}  "
              + " ".join(_fmt(r["train"], 0) for r in rs))
    for v in seeds:
        ratio = {c: (med[v][c] / med["run"][c]  # type: ignore[operator]
                     if med[v][c] and med["run"][c] else None) for c in cols}
        _emit(f"{v + '/run':<10} " + " ".join(_fmt(ratio[c], 10, 3) for c in cols))
    _emit()
    over_exited = {v: _median([r["samples"] / r["exited"] for r in runs[v]]) for v in variants}
    _emit("samples over exited s (`ravnest run`'s own figure in summary.json): "
          + ", ".join(f"{v} {_fmt(over_exited[v], 0, 1)}" for v in variants)
          + f"; seed clusterize() "
          f"{_fmt(_median([r['planned'] for v in seeds for r in runs[v]]), 0)} s (in wall s)")
    _emit("(train s: seed = the root's trainer.train(), run = its learning curve; curve s: the "
          "root's learning curve, first row to last plus one update; samples/s = samples / "
          "train s; exited s: process start to the last exit; threads: torch's in the root; "
          "ratios > 1: the seed figure is larger)")
    _emit(f"({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
