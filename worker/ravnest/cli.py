"""The `ravnest` command line: flags in, one call out."""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

from ravnest import termination
from ravnest._version import __version__
from ravnest.errors import RavnestError, SpecError
from ravnest.run.metadata import TOKEN_ENV, TORCH_THREADS_ENV, NodeMetadata
from ravnest.storing import PVC_ROOT, PVC_ROOT_ENV


def _stop_on(*signums: int) -> None:
    """Turn these signals into `Terminated`, so that the runner stops its workers and records
    the run; a second signal is ignored rather than cut that short."""
    from ravnest.run.local import Terminated

    def terminate(signum: int, _frame: object) -> None:
        for s in signums:
            signal.signal(s, signal.SIG_IGN)
        raise Terminated(signum)

    for s in signums:
        signal.signal(s, terminate)


def _run(args: argparse.Namespace) -> int:
    from ravnest.run.local import Terminated, run_job
    from ravnest.spec import load_job

    job = load_job(args.job)
    out = Path(args.output or Path("runs") / job.name)
    _stop_on(signal.SIGTERM, signal.SIGHUP)
    try:
        summary = run_job(job, out, progress=not args.no_progress, source=args.job)
    except Terminated as e:
        print(f"error: {e}", file=sys.stderr)
        return 128 + e.signum
    speed = (f"{summary['samples_per_second']} samples/s" if summary["samples_trained"] else
             f"nothing left to train (its checkpoints are at step {summary['resumed_from_step']})")
    figures = [f"{what} {summary[key]:.4f}" for what, key in (
        ("train loss", "train_loss"), ("val loss", "val_loss"),
        ("val accuracy", "fused_val_metric")) if summary[key] is not None]
    print(f"done: {summary['updates']} updates, {speed}" + "".join(f", {f}" for f in figures))
    where = summary["model"].rsplit("/", 1)[0]
    print(f"outputs in {where}/ (model.pt, best_model.pt, learning_curve.csv and .png, "
          f"summary.json); run folder {out}/")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from ravnest.spec import load_job

    if args.termination_log:
        return _plan_pod(args.job)
    job = load_job(args.job)  # a bad file is refused before torch is loaded
    from ravnest.plan.building import preflight

    plan, _, _ = preflight(job)
    print(json.dumps(plan.to_dict(), indent=1) if args.json else plan.table())
    return 0


def _plan_pod(job_file: str) -> int:
    """A planner pod's work: plan the job, check it can write the storage its checkpoints and
    outputs name, leave the plan (or what went wrong) as the container's termination message for
    the operator, and show the table in the pod's log."""
    from ravnest.plan.building import preflight, probe_storage
    from ravnest.plan.handoff import encode
    from ravnest.run.owning import claim_checkpoints
    from ravnest.spec import load_job

    try:
        job = load_job(job_file)
        plan, _, _ = preflight(job)
        pvc_root = os.environ.get(PVC_ROOT_ENV, PVC_ROOT)
        probe_storage(job.spec, pvc_root)
        claim_checkpoints(job, pvc_root)
        termination.write(encode(plan), in_pod=True)
    except SpecError as e:
        termination.write("invalid job: " + "; ".join(e.problems), in_pod=True)
        raise
    except Exception as e:  # the job's own code failed: say what, then the traceback in the log
        termination.write_error(e, in_pod=True)
        raise
    print(plan.table())
    print(f"plan {plan.fingerprint} handed back in {termination.destination(in_pod=True)}")
    return 0


def _validate(args: argparse.Namespace) -> int:
    from ravnest.spec import load_job

    job = load_job(args.job)
    print(f"{args.job}: valid RavnestJob {job.name!r}")
    return 0


def _read_status(args: argparse.Namespace) -> dict[str, Any]:
    local = Path(args.output or Path("runs") / args.job) / "status.json"
    if not args.kube and local.exists():
        return dict(json.loads(local.read_text()))
    cmd = ["kubectl", "get", "ravnestjob", args.job, "-o", "json"]
    if args.namespace:
        cmd += ["-n", args.namespace]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RavnestError(f"no local run {local} and kubectl failed: {e}") from e
    if out.returncode != 0:
        where = "" if args.kube else f"no local run at {local}, and "
        last = (out.stderr.strip().splitlines() or ["failed"])[-1]
        raise RavnestError(f"{where}kubectl: {last}")
    return dict(json.loads(out.stdout).get("status") or {"phase": "Pending"})


def _spare_lines(status: dict[str, Any]) -> list[str]:
    """The hot spares and the stages they took over, of a local run (status.json: a list of
    spares, a list of takeovers) or a RavnestJob (spare -> pod phase, node -> provider)."""
    lines = []
    spares = status.get("spares")
    if isinstance(spares, dict) and spares:
        lines.append("spares: " + ", ".join(f"{n} ({p})" for n, p in sorted(spares.items())))
    elif isinstance(spares, list) and spares:
        lines.append("spares: " + ", ".join(map(str, spares)))
    taken = status.get("takeovers")
    if isinstance(taken, dict):
        lines += [f"{n} runs on provider {p} (a spare took it over)"
                  for n, p in sorted(taken.items())]
    elif isinstance(taken, list):
        lines += [f"{t.get('node')} runs on provider {t.get('provider')} ({t.get('spare')} took it "
                  f"over from provider {t.get('lost')})" for t in taken if isinstance(t, dict)]
    return lines


def _drain_lines(status: dict[str, Any]) -> list[str]:
    """Clusters training / planned (as `kubectl get rj` shows them), those that drain or
    drained, and those added (a local run's status.json, or a RavnestJob's status)."""
    lines = []
    clusters = status.get("clusters")
    if isinstance(clusters, str) and clusters:
        lines.append(f"clusters: {clusters} (training/planned)")
    versions = (status.get("membership") or {}).get("versions") or []
    if len(versions) > 1 and isinstance(versions[-1], dict):
        v = versions[-1]
        lines.append(f"membership v{v.get('version')} from round {v.get('fromRound')}: clusters "
                     f"{', '.join(map(str, v.get('clusters') or []))}")
    for d in status.get("draining") or []:  # (ordered, not drained yet)
        if isinstance(d, dict):
            lines.append(f"cluster {d.get('cluster')} draining: provider(s) "
                         f"{', '.join(map(str, d.get('providers') or []))} removed")
    for d in status.get("notDrained") or []:
        if isinstance(d, dict) and isinstance(d.get("cluster"), int):
            from ravnest.run.elastic import not_drained
            lines.append(not_drained(d["cluster"]))
    for d in status.get("drained") or []:
        if isinstance(d, dict):
            lines.append(f"cluster {d.get('cluster')} drained after round {d.get('round')} "
                         f"(update {d.get('updates')})")
    for g in status.get("grown") or []:
        if isinstance(g, dict):
            lines.append(f"cluster(s) {', '.join(map(str, g.get('clusters') or []))} added: "
                         f"provider(s) {', '.join(map(str, g.get('providers') or []))}")
    for j in status.get("joined") or []:
        if isinstance(j, dict):
            lines.append(f"cluster {j.get('cluster')} joined after round {j.get('round')}")
    return lines


def _status(args: argparse.Namespace) -> int:
    from ravnest.run.jobstatus import FINISHED, Phase
    from ravnest.run.progress import render

    while True:
        status = _read_status(args)
        line = render(status)
        if args.watch and sys.stdout.isatty():
            print("\r" + line, end="", flush=True)
        else:
            print(line, flush=True)
        if not args.watch or status.get("phase") in FINISHED:
            break
        time.sleep(args.interval)
    if args.watch and sys.stdout.isatty():
        print()
    for name, node in sorted((status.get("nodes") or {}).items()):
        print(f"  {name:10} {node.get('pod', ''):24} {node.get('phase', '')}"
              + (f" exit {node['exitCode']}" if "exitCode" in node else ""))
    for line in _spare_lines(status):
        print(f"  {line}")
    for line in _drain_lines(status):
        print(f"  {line}")
    for cond in status.get("conditions") or []:
        if cond.get("status") == "True" and cond.get("message"):
            print(f"  {cond['type']}: {cond['message']}")
    for key, where in (status.get("outputs") or {}).items():
        print(f"  {'outputs' if key == 'uri' else key}: {where}")
    return 1 if status.get("phase") == Phase.FAILED else 0


def _drain(args: argparse.Namespace) -> int:
    from ravnest.run.draining import order_drain
    from ravnest.run.locking import held

    out = Path(args.output or Path("runs") / args.job)
    clusters = order_drain(out, args.provider, running=held(out))
    if not clusters:
        print(f"{out}: the cluster(s) of provider(s) {', '.join(map(str, args.provider))} "
              f"already drain")
        return 0
    print(f"{out}: cluster(s) {', '.join(map(str, clusters))} drain at a round boundary; the "
          f"others train on (`ravnest status {args.job}` shows it)")
    return 0


def _grow(args: argparse.Namespace) -> int:
    from ravnest.run.growing import order_growth
    from ravnest.run.locking import held
    from ravnest.spec import load_job

    job = load_job(args.job)
    out = Path(args.output or Path("runs") / job.name)
    added = order_growth(out, job, running=held(out))
    print(f"{out}: provider(s) {', '.join(map(str, added))} join the running job as new "
          f"cluster(s) at a round boundary; the others train on (`ravnest status {job.name}` "
          f"shows it)")
    return 0


def _worker(args: argparse.Namespace) -> int:
    import torch

    from ravnest.run.worker import Worker, exit_with_runner
    from ravnest.train import heap

    exit_with_runner(os.environ)

    threads = os.environ.get(TORCH_THREADS_ENV)
    if threads:
        torch.set_num_threads(int(threads))
    token = os.environ.get(TOKEN_ENV, "")
    if not token and args.token_file:
        token = Path(args.token_file).read_text().strip()
    # In a container the worker is PID 1, for which an unhandled SIGTERM is ignored: without this,
    # `kubectl delete pod` would wait out the whole grace period before SIGKILL.
    def terminate(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    # `kill -USR1 <pid>` writes every thread's stack to the log: where a worker waits, without
    # stopping it
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    heap.tune(os.environ)
    try:
        meta = NodeMetadata.load(args.metadata)
        if args.spare:
            from ravnest.run.worker import hold_as_spare

            taken = hold_as_spare(meta, sys.stdin if args.orders == "-" else None)
            if taken is None:
                return 0
            meta = taken
        Worker(meta, token, pvc_root=os.environ.get(PVC_ROOT_ENV, PVC_ROOT)).run()
    except Exception as e:  # say why where the operator reads it; the traceback goes to the log
        termination.write_error(e)
        raise
    return 0


def _finish(args: argparse.Namespace) -> int:
    """A finishing pod's work (`ravnest finish --metadata node.json`): fuse the stages the workers
    left in the job's output location and write the outputs there; its termination message says
    where they are and the fused model's figures, or what went wrong."""
    from ravnest.run import finishing

    try:
        meta = NodeMetadata.load(args.metadata)
        if meta.job is None:
            raise SpecError([f"{args.metadata}: the node metadata names no job"])
        where = finishing.output_location(meta.job.spec, meta.output_dir,
                                          os.environ.get(PVC_ROOT_ENV, PVC_ROOT))
        summary = finishing.finish(meta.job, meta.plan, where)
    except Exception as e:  # the job's code or the storage failed: say what; traceback in the log
        termination.write_error(e, in_pod=True)
        raise
    handed = {"outputs": finishing.outputs(where, summary),
              **{k: summary[k] for k in ("fused_val_loss", "fused_val_metric", "samples_per_second",
                                         "seconds", "resumed_from_step")}}
    termination.write_figures(handed, in_pod=True)
    print(json.dumps(summary, indent=1))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ravnest", description=__doc__)
    p.add_argument("--version", action="version", version=f"ravnest {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="train a job locally, one process per provider")
    r.add_argument("job", help="RavnestJob YAML file")
    r.add_argument("-o", "--output", help="output folder (default runs/<job name>)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.set_defaults(func=_run)
    pl = sub.add_parser("plan", help="print the clusters and stages of a job")
    pl.add_argument("job")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.add_argument("--termination-log", action="store_true",
                    help="as a planner pod: hand the plan (or the error) back as the container's "
                         f"termination message (${termination.TERMINATION_LOG_ENV} or "
                         f"{termination.KUBELET_PATH})")
    pl.set_defaults(func=_plan)
    v = sub.add_parser("validate", help="check a job file")
    v.add_argument("job")
    v.set_defaults(func=_validate)
    s = sub.add_parser("status", help="show a job's phase and progress (local run or cluster)")
    s.add_argument("job", help="job name")
    s.add_argument("-o", "--output", help="local run folder (default runs/<job>)")
    s.add_argument("--kube", action="store_true", help="ask the cluster (kubectl) only")
    s.add_argument("-n", "--namespace", help="namespace of the RavnestJob")
    s.add_argument("-w", "--watch", action="store_true", help="follow until it finishes")
    s.add_argument("--interval", type=float, default=2.0, help="seconds between updates")
    s.set_defaults(func=_status)
    d = sub.add_parser("drain", help="remove providers from a running local job: their "
                                     "clusters leave at a round boundary, the others train on")
    d.add_argument("job", help="job name")
    d.add_argument("-o", "--output", help="local run folder (default runs/<job>)")
    d.add_argument("--provider", type=int, action="append", required=True,
                   help="index of a provider to remove (spec.providers; repeat for several)")
    d.set_defaults(func=_drain)
    g = sub.add_parser("grow", help="add providers to a running local job: the job file lists "
                                    "them after its own; they form clusters that join it")
    g.add_argument("job", help="the edited job file (providers added at the end)")
    g.add_argument("-o", "--output", help="local run folder (default runs/<job>)")
    g.set_defaults(func=_grow)
    w = sub.add_parser("worker", help="run one worker from its node metadata")
    w.add_argument("--metadata", required=True, help="node metadata JSON file")
    w.add_argument("--token-file", help=f"file with the job token (default: ${TOKEN_ENV})")
    w.add_argument("--spare", action="store_true",
                   help="wait as a hot spare (the metadata's node is the spare's name): build "
                        "the job's model, then wait until stopped, or, with --orders -, take "
                        "over the node whose metadata an order on stdin names")
    w.add_argument("--orders", choices=["-"],
                   help="with --spare: read the order to take over a node from stdin (the local "
                        "runner's spares; exit when stdin closes)")
    w.set_defaults(func=_worker)
    f = sub.add_parser("finish", help="as a finishing pod: fuse a trained job's stages and "
                                      "write its outputs (model, curve, summary)")
    f.add_argument("--metadata", required=True, help="node metadata JSON file")
    f.set_defaults(func=_finish)
    _forkserver_parser(sub)
    return p


def _forkserver_parser(sub: Any) -> None:
    fs = sub.add_parser("forkserver", help="(the local runner's) fork the processes asked for "
                                           "on a socket, torch imported once (run/spawning.py)")
    fs.add_argument("--fd", type=int, required=True, help="the socket's file descriptor")
    fs.add_argument("--preload", action="append", default=[], help="a module to import first")
    fs.set_defaults(func=_forkserver)


def _forkserver(args: argparse.Namespace) -> int:
    from ravnest.run import spawning

    return spawning.serve(args.fd, args.preload, entry)


def entry(argv: list[str]) -> NoReturn:
    """The process's end for `ravnest <argv>`, as `python -m ravnest` runs it (the fork server's
    children too): a worker (`ravnest worker`) leaves with `os._exit` once it is done, its outputs
    written: gRPC's threads may still hold a stream to a peer behind a network cut, and the
    interpreter's own exit would wait for them for good (seen: a worker that finished its job
    never exited). Its output streams and logs are flushed first; every other command exits as
    usual."""
    if "worker" not in argv[0:2]:
        sys.exit(main(argv))
    try:
        code = main(argv)
    except SystemExit as e:  # a signal (SIGTERM: 143), or argparse
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        force=True)  # (a fork server's child: its own level and streams)
    for chatty in ("botocore", "aiobotocore", "s3fs", "fsspec", "matplotlib"):
        # their INFO lines ("Found credentials in environment variables") are not the job's
        logging.getLogger(chatty).setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    try:
        return int(args.func(args))
    except SpecError as e:
        print("error: invalid job:\n  " + "\n  ".join(e.problems), file=sys.stderr)
        return termination.SPEC_ERROR_EXIT
    except RavnestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
