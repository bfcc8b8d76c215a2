"""The local runner: `ravnest run job.yaml` on one machine, no cluster needed.

It validates and plans the job (nothing starts if that fails), starts one worker process per
provider on 127.0.0.1 (`LocalRun.host`), shows progress read from the roots' Prometheus endpoints,
and when every worker succeeded writes the run's outputs into one folder (the trained model and
its figures go to ``spec.output.uri`` instead when the job names one, e.g.
``s3://bucket/prefix``; see `finishing`):

- ``model.pt``: the fused trained model, a state_dict with the original parameter names;
- ``best_model.pt``: the model with the lowest smoothed validation loss;
- ``learning_curve.csv``, ``learning_curve.png`` and ``summary.json`` (losses, accuracy,
  samples/s, plan);
- ``plan.txt``, ``nodes/*.json`` (node metadata), ``logs/*.log``, ``checkpoints/``;
- ``tls/<node>/`` with `spec.security.tls`: the job CA's certificate and the node's certificate and
  key (a fresh CA per run, whose own key is never written).

The folder is the run's own: while a run holds ``run.lock`` (which names it: pid, start time), a
second run into the folder is refused at once and changes nothing there. Everything in it, the
runner's and the workers' files, is its owner's only (0700 folders, 0600 files, as TLS keys).
SIGTERM or SIGHUP stops the workers and records the run as Failed (`ravnest run` exits with 128 +
the signal's number); if the runner dies outright (SIGKILL), the kernel kills its workers (Linux's
parent-death signal, see `ravnest.run.worker.exit_with_runner`).

What to do on each pass over the running workers (twice a second) is decided by
`supervising.decide_running`, as the operator decides it for a job's pods; this runner carries it
out with processes. If a worker dies in a job of several
clusters (`spec.runPolicy.recovery: cluster`, the default),
only its cluster is stopped and started again: the other clusters train on, their ring rounds
going without it, and the restarted workers take their stages' state from the nodes that hold the
same parameters in the other clusters and rejoin at a round boundary (train/rejoining.py says
which batches the paused cluster skips). At most `spec.runPolicy.recoveryLimit` such recoveries,
each logged and counted in ``status.json``. Otherwise (one cluster, no other cluster whole, a
cluster that failed the same way twice, the limit reached, or `recovery: job`) every worker is
stopped and the whole run restarts from the newest checkpoint complete for all nodes, as the
operator restarts a job's pods: at most `spec.runPolicy.backoffLimit` times, each restart logged
and counted in ``status.json``. Past that limit, or when it failed the same way as before its last
restart, the run fails: no process is left behind, and the error names the node, its exit code and
the end of its log. A cluster lost while another is finishing is not restarted: once the others
have finished, the run ends without it.

With `spec.plan.spares`, the providers the planner set aside run as hot spares (`ravnest worker
--spare`: started with the workers, the job's model built, waiting on stdin). When a cluster is
restarted alone, the free spare whose RAM holds the lost node's stage (`elastic.spare_for`) takes
that stage over at once, its metadata named on its stdin, while the cluster's other workers
start again; the lost provider becomes a spare in its turn (started again, cold). At a whole
restart a free spare's provider runs the lost node's stage from then on in the same way, as the
operator places that node's new pod (`elastic.choose_spares`, for both). ``status.json``
lists the spares and each takeover, and ``logs/<node>.log`` says which spare's log the node goes
on in.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ravnest import termination
from ravnest.comm.identity import Authority
from ravnest.comm.tls import identity, issue, make_authority
from ravnest.errors import PlanError, SpecError, WorkerFailed
from ravnest.plan import building
from ravnest.plan.plans import Plan, SparePlan, spare_name
from ravnest.run import (
    draining,
    elastic,
    finishing,
    growing,
    jobstatus,
    owning,
    spawning,
    supervising,
)
from ravnest.run.jobstatus import FINISHED, Phase
from ravnest.run.locking import lock_folder, refuse_if_locked
from ravnest.run.metadata import (
    DEVICE_ENV,
    DRAIN_DIR_ENV,
    GONE_ENV,
    REJOIN_ENV,
    RUNNER_PID_ENV,
    TOKEN_ENV,
    TORCH_THREADS_ENV,
    NodeMetadata,
    endpoint,
    host_of,
)
from ravnest.run.progress import final as final_progress
from ravnest.run.progress import progress, scrape
from ravnest.spec import Job
from ravnest.storing import Location, open_location, pvc_claim
from ravnest.train import checkpointing, devices

log = logging.getLogger(__name__)

PRIVATE_UMASK = 0o077
"""The umask of a run and its workers: its folders 0700, its files 0600."""


class Terminated(BaseException):
    """The runner was told to stop (SIGTERM, SIGHUP). A BaseException, as KeyboardInterrupt, so
    that no `except Exception` on the way turns it into an error of the job."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"ravnest run stopped by {signal.Signals(signum).name}; "
                         f"its workers were stopped")


def free_ports(n: int, span: int = 1) -> list[int]:
    """n free TCP ports on 127.0.0.1, each the first of `span` consecutive free ports (span=2 for
    a seed provider whose ring data plane listens one port above it). They are taken below the
    kernel's ephemeral range (`_quiet_ports`) where it has one: a port there is never given to an
    outgoing connection or to a bind to port 0, so nothing but another program that picks its
    own ports can take it before the worker it is for listens on it (one from the ephemeral range,
    free when picked, was once held by a connection of a program that happened to run beside).
    All are held until every one is found, so none is handed out twice."""
    held: list[socket.socket] = []
    ports: list[int] = []
    quiet = _quiet_ports()
    tries = 0
    try:
        while len(ports) < n:
            tries += 1
            if quiet is not None and tries <= 50 * n:
                first = _bound(secrets.choice(quiet))
                if first is None:
                    continue
            else:  # (no such range, or it is full: what the kernel gives)
                first = socket.socket()
                first.bind(("127.0.0.1", 0))
            held.append(first)
            port = first.getsockname()[1]
            rest = [_bound(port + k) for k in range(1, span)] if port + span <= 65536 else [None]
            held.extend(s for s in rest if s is not None)
            if all(s is not None for s in rest):
                ports.append(port)
    finally:
        for s in held:
            s.close()
    return ports


def _quiet_ports() -> range | None:
    """The ports from 10000 to just below the kernel's ephemeral range (Linux's
    ip_local_port_range), or None where that range is not known or leaves too few."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return range(10000, low - 8) if low - 8 - 10000 >= 1000 else None


def _bound(port: int) -> socket.socket | None:
    """A socket bound to 127.0.0.1:port, or None when that port is taken."""
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        s.close()
        return None
    return s


def node_endpoints(names: Sequence[str], hosts: Mapping[str, str], tcp_ring: bool,
                   ) -> tuple[dict[str, str], dict[str, int], dict[str, str] | None]:
    """Free ports for each node on its host: its gRPC address, its metrics port, and with a TCP
    ring (training.ringTransport: tcp) its ring data address, else None."""
    ports = iter(free_ports((3 if tcp_ring else 2) * len(names)))
    addresses = {n: endpoint(hosts[n], next(ports)) for n in names}
    metrics_ports = {n: next(ports) for n in names}
    ring_addresses = {n: endpoint(hosts[n], next(ports)) for n in names} if tcp_ring else None
    return addresses, metrics_ports, ring_addresses


Process = subprocess.Popen[bytes] | spawning.Forked
"""A worker's process: forked by the run's fork server, or started as a program of its own."""

LOOPBACK = "127.0.0.1"
"""Where a local run's workers listen and are reached, unless `LocalRun.host` says otherwise."""


@dataclass
class _Proc:
    node: str
    popen: Process
    log: Path
    metrics_port: int
    host: str = LOOPBACK
    """The host its metrics port listens on."""


class LocalRun:
    """One local run of a job."""

    def __init__(self, job: Job, output_dir: str | Path, progress: bool = True,
                 worker_threads: int = 1, source: str | Path | None = None) -> None:
        """`source`: the job file the job came from (part of its identity in the checkpoint
        folder it writes, `owning.identity`)."""
        self.job = job
        self.source = source
        self.lease: owning.Lease | None = None
        """This run's lease on its checkpoint folder (`owning`), from `prepare` to `release`."""
        self.out = Path(output_dir)
        self.progress = progress
        self.worker_threads = worker_threads
        self.procs: list[_Proc] = []
        self.plan: Plan | None = None
        self.memory = supervising.Memory()
        """What the supervisor keeps between decisions (`supervising.after_loss`)."""
        self.recoveries: list[dict[str, Any]] = []
        """The clusters restarted alone: cluster, the worker that failed, how, and when."""
        self._token = ""
        self.abandoned: set[int] = set()
        """Clusters that failed once every other one had finished: the run ends without them."""
        self.resumed_from = 0
        """The checkpoint step the run started from (0: from scratch)."""
        self.conditions: supervising.Conditions = []
        """The run's conditions, as the operator keeps a job's (`supervising`'s transitions)."""
        self._lock: int | None = None
        self.outputs: dict[str, str] = {}
        """Where `finish` wrote each output (status.json's outputs)."""
        self._started = time.monotonic()
        self._wall_start = time.time()
        self.spares: list[SparePlan] = []
        """The providers that are spares now: the plan's, less those that took over a stage,
        plus the providers they took over from."""
        self.spare_procs: dict[str, _Proc] = {}
        """The running hot spares, by spare name."""
        self.takeovers: list[dict[str, Any]] = []
        """Stages a spare took over: node, spare, its provider, the provider lost, when."""
        self._ram: dict[int, float] = {}
        """Each provider's RAM in GB, by provider index (as planned)."""
        self.drained: dict[int, dict[str, Any]] = {}
        """The clusters that drained (`ravnest drain`): what each one's root said when it did."""
        self._env: dict[str, str] = {}
        self.metas: list[NodeMetadata] = []
        """The node metadata of every node of the plan (those of clusters added since too)."""
        self.grow_orders = 0
        """The grow orders (`ravnest grow`) read so far, each acted on or refused."""
        self.grow_seen: set[str] = set()
        """Their file names."""
        self.orders_refused: set[str] = set()
        """The files in the drain folder refused as no drain order (said once each)."""
        self.grown: list[dict[str, Any]] = []
        """The grow orders acted on: the providers added, the clusters they form, when."""
        self.joined: dict[int, dict[str, Any]] = {}
        """The clusters added to the running job that joined it: what each one's root said."""
        self.rejoining: set[int] = set()
        """The clusters restarted alone or added to the running job whose workers do not all
        run yet (`supervising.back_again`)."""
        self._ca: Any = None
        self._spawner: spawning.Spawner | None = None  # (`_worker_process`)
        self._authority = Authority.fresh()
        """Issues the nodes' identities (comm/identity.py); kept in memory: a grow issues more."""

    def prepare(self) -> list[NodeMetadata]:
        claims = [f"{field}: {uri!r} names a PersistentVolumeClaim, which only pods on Kubernetes "
                  f"mount; on this machine give a path or an object store (s3://…)"
                  for field, uri in (("spec.checkpoint.path", self.job.spec.checkpoint.path),
                                     ("spec.output.uri", self.job.spec.output.uri))
                  if uri and pvc_claim(uri)]
        if claims:
            raise SpecError(claims)
        checkpoints = self.checkpoint_dir()
        plan, _, _ = building.preflight(self.job, checkpoints)
        self.plan = plan
        self._check_devices(plan)
        warning = memory_warning(plan, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        if warning:
            log.warning("%s", warning)
        checkpointing.refuse_other_plans(checkpoints, plan.fingerprint)
        self.claim()
        self.lease = owning.claim(checkpoints, self.job, self.source).keep()
        names = plan.names()
        addresses, metrics_ports, ring_addresses = node_endpoints(
            names, {n: self.host(plan.node(n).provider) for n in names},
            self.job.spec.training.ring_transport == "tcp")
        if self.job.spec.security.tls:
            self._ca = make_authority(self.job.name)  # (kept in memory: a grow issues more)
        tls_dirs = {n: self._certify(n, host_of(addresses[n])) for n in names}
        metas = [NodeMetadata(job=self.job, plan=plan, node=n, addresses=addresses,
                              output_dir=str(self.out.resolve()), listen=addresses[n],
                              metrics_port=metrics_ports[n], tls_dir=tls_dirs[n],
                              ring_addresses=ring_addresses,
                              ring_listen=ring_addresses[n] if ring_addresses else "",
                              identity_file=self._identify(n))
                 for n in names]
        (self.out / "nodes").mkdir(parents=True, exist_ok=True)
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.out / draining.DRAIN_DIR, ignore_errors=True)  # a past run's
        (self.out / draining.DRAIN_DIR).mkdir()
        for m in metas:
            m.save(self.out / "nodes" / f"{m.node}.json")
        self._ram = {**{n.provider: n.ram_gb for n in plan.nodes},
                     **{sp.provider: sp.ram_gb for sp in plan.spares}}
        self.spares = list(plan.spares)  # their metadata files: `_start_spare`
        (self.out / "plan.txt").write_text(plan.table() + "\n")
        shutil.rmtree(self.out / growing.GROW_DIR, ignore_errors=True)  # a past run's
        (self.out / growing.GROW_DIR).mkdir()
        return metas

    def start(self, metas: list[NodeMetadata], rejoin: bool = False) -> None:
        """Start a worker for each of `metas` (`rejoin`: the workers of a cluster restarted
        alone, which rejoin the others)."""
        if not rejoin:
            self._token = secrets.token_hex(16)
        assert self.plan is not None
        gone = elastic.gone_nodes(self.plan, self.drained)
        self._env = {**os.environ, TOKEN_ENV: self._token,
                     "OMP_NUM_THREADS": str(self.worker_threads),
                     TORCH_THREADS_ENV: str(self.worker_threads), RUNNER_PID_ENV: str(os.getpid()),
                     DRAIN_DIR_ENV: str((self.out / draining.DRAIN_DIR).resolve()),
                     GONE_ENV: ",".join(gone)}
        env = {**self._env, **({REJOIN_ENV: "1"} if rejoin else {})}
        if not rejoin:
            self.stop(list(self.spare_procs.values()), grace=0)
            self.spare_procs = {}
            for sp in self.spares:
                self._start_spare(sp)
        for m in metas:
            logfile = self.out / "logs" / f"{m.node}.log"
            popen = self._worker_process(
                self._runs_on(m.node), ["worker", "--metadata",
                                        str(self.out / "nodes" / f"{m.node}.json")], env, logfile)
            self.procs.append(_Proc(m.node, popen, logfile, m.metrics_port, host_of(m.listen)))

    def _worker_process(self, provider: int, args: list[str], env: dict[str, str],
                        logfile: Path, orders: bool = False) -> Process:
        """Start `ravnest <args>` for `provider`, with `env`, its output appended to `logfile`,
        in a session of its own; `orders`: its stdin a pipe (else nothing). A CPU provider's
        worker is forked from the run's fork server (`spawning`: torch imported once), unless a
        subclass wraps its command line (`launch`) or its environment changes what a process
        reads as it starts (`Spawner.forks`); a GPU's is a process of its own (a CUDA context
        does not survive a fork)."""
        env = termination.local_env(self._on_device(env, provider), logfile)
        argv = [sys.executable, "-m", "ravnest", *args]
        command = self.launch(provider, argv)
        with open(logfile, "ab") as fh:
            if command == argv and env[DEVICE_ENV] == "cpu":
                if self._spawner is None or not self._spawner.alive:
                    self._spawner = spawning.Spawner(
                        {**os.environ, "OMP_NUM_THREADS": str(self.worker_threads)})
                if self._spawner.forks(env):
                    return self._spawner.spawn(
                        args, self._spawner.parent_env(env, RUNNER_PID_ENV), fh.fileno(),
                        stdin=subprocess.PIPE if orders else subprocess.DEVNULL,
                        umask=PRIVATE_UMASK, title=argv)
            return subprocess.Popen(
                command, stdout=fh, stderr=subprocess.STDOUT,
                stdin=subprocess.PIPE if orders else subprocess.DEVNULL, env=env,
                start_new_session=True, umask=PRIVATE_UMASK)

    def _check_devices(self, plan: Plan) -> None:
        """Every cuda provider's device is there (RavnestError naming the provider and what
        torch reports, before any worker starts); providers that share a GPU are said."""
        spec = self.job.spec
        resolved = {p.device: str(devices.resolve(p.device, f"spec.providers[{i}].device"))
                    for i, p in enumerate(spec.providers) if p.device != "cpu"}
        pool = spec.expanded_providers()
        on: dict[str, list[str]] = {}
        for name, provider in [(n.name, n.provider) for n in plan.nodes] + [
                (sp.name, sp.provider) for sp in plan.spares]:
            if pool[provider].device != "cpu":
                on.setdefault(resolved[pool[provider].device], []).append(name)
        for where, names in on.items():
            if len(names) > 1:
                log.warning("%d workers share %s (%s): each trains its stage there, with the "
                            "memory its provider's ram gives it", len(names), where,
                            ", ".join(names))

    def _on_device(self, env: dict[str, str], provider: int) -> dict[str, str]:
        """`env` for a worker of `provider`: with that provider's device."""
        return {**env, DEVICE_ENV: self.job.spec.expanded_providers()[provider].device}

    def host(self, provider: int) -> str:
        """The address the workers of provider `provider` (an index into the job's providers)
        listen on and are reached at: the loopback here. A subclass may put providers on hosts
        of their own (bench/bandwidth.py: network namespaces with links of their own speeds);
        a hot spare keeps the address of the node it takes over."""
        return LOOPBACK

    def launch(self, provider: int, argv: list[str]) -> list[str]:
        """The command line that runs `argv` (a worker of provider `provider`): `argv` itself
        here; a subclass may wrap it (bench/bandwidth.py: `ip netns exec HOST ...`)."""
        return argv

    def _start_spare(self, spare: SparePlan) -> None:
        """Start a hot spare: a worker that builds the job's model and waits on its stdin for the
        node metadata of the stage it is to take over (`ravnest.run.worker.hold_as_spare`)."""
        assert self.plan is not None
        path = self.out / "nodes" / f"{spare.name}.json"  # written each time: this run's plan
        other = NodeMetadata.load(self.out / "nodes" / f"{self.plan.nodes[0].name}.json")
        replace(other, node=spare.name, identity_file=None).save(path)  # (joins no peer)
        logfile = self.out / "logs" / f"{spare.name}.log"
        popen = self._worker_process(
            spare.provider, ["worker", "--spare", "--orders", "-", "--metadata", str(path)],
            self._env, logfile, orders=True)
        self.spare_procs[spare.name] = _Proc(spare.name, popen, logfile, 0)

    def _free_spares(self) -> list[SparePlan]:
        """The hot spares whose processes run (held, waiting for an order)."""
        return [sp for sp in self.spares if sp.name in self.spare_procs]

    def _hand_over(self, node: str, cluster: int, spare: SparePlan) -> int:
        """From now on `node`'s worker runs as `spare`'s provider, and the provider that ran it
        is a spare (recorded in status.json's takeovers); that provider."""
        lost = self._runs_on(node)
        self.spares.remove(spare)
        self.spares.append(SparePlan(spare_name(lost), lost, self._ram[lost]))
        self.takeovers.append({"node": node, "cluster": cluster, "spare": spare.name,
                               "provider": spare.provider, "lost": lost,
                               "at": round(time.time(), 3)})
        return lost

    def _take_over(self, meta: NodeMetadata, cluster: int, spare: SparePlan) -> bool:
        """Hand the lost node's stage (`meta`) to the hot spare `spare`, which holds it: the
        spare's process becomes that node's worker (it rejoins with its cluster), and the lost
        provider becomes a spare, started again. False: the spare could not be told."""
        node = meta.node
        assert self.plan is not None
        proc = self.spare_procs.pop(spare.name)
        gone = elastic.gone_nodes(self.plan, self.drained)
        order = json.dumps({"metadata": str(self.out / "nodes" / f"{node}.json"), "rejoin": True,
                            "gone": gone})  # (drained since the spare was started)
        try:
            assert proc.popen.stdin is not None
            proc.popen.stdin.write(order.encode() + b"\n")
            proc.popen.stdin.close()
        except OSError:  # it died meanwhile: wait() drops it; the node starts as usual
            log.warning("spare %s could not be told to take over %s", spare.name, node)
            self.stop([proc], grace=0)
            self.spares.remove(spare)
            return False
        self.procs.append(_Proc(node, proc.popen, proc.log, meta.metrics_port,
                                host_of(meta.listen)))
        lost = self._hand_over(node, cluster, spare)
        with open(self.out / "logs" / f"{node}.log", "a") as fh:
            fh.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} provider {lost} lost: spare "
                     f"{spare.name} (provider {spare.provider}) took over {node}; its log goes on "
                     f"in {proc.log.name}\n")
        self._start_spare(self.spares[-1])
        return True

    def _reassign(self, down: Sequence[supervising.Seen]) -> dict[str, str]:
        """At a whole restart, as the operator places the lost nodes' new pods: each node of
        `down` whose stage a free hot spare holds (`elastic.choose_spares`) runs as that spare's
        provider from the restart on, and its provider becomes a spare (every worker and spare
        starts again). Node -> the spare that took its stage over."""
        assert self.plan is not None
        chosen = elastic.choose_spares(self.plan, [s.node for s in down], self._free_spares())
        for node, spare in chosen.items():
            self._hand_over(node, self.plan.node(node).cluster, spare)
        return {node: spare.name for node, spare in chosen.items()}

    def _runs_on(self, node: str) -> int:
        """The provider that runs `node` now (its planned one, until a spare took it over)."""
        assert self.plan is not None
        taken = [t["provider"] for t in self.takeovers if t["node"] == node]
        return taken[-1] if taken else self.plan.node(node).provider

    def stop(self, procs: list[_Proc] | None = None, grace: float = 5.0) -> None:
        """Terminate every worker and spare still running (their whole process groups), or those
        of `procs`, killing those still there after `grace` seconds."""
        procs = [*self.procs, *self.spare_procs.values()] if procs is None else procs
        for p in procs:
            if p.popen.poll() is None:
                _signal_group(p.popen.pid, signal.SIGTERM if grace else signal.SIGKILL)
        deadline = time.monotonic() + grace
        for p in procs:
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p.popen.pid, signal.SIGKILL)
                p.popen.wait()

    def wait(self) -> supervising.Running:
        """Watch the workers, a pass every 0.5 s, until one's decision
        (`supervising.decide_running`) is to act on a loss or to finish, and return it. Ends the
        job without the clusters the decision says; raises when the job runs past its deadline."""
        assert self.plan is not None
        roots = {c.id: p for c in self.plan.clusters for p in self.procs
                 if p.node == c.nodes[0]}  # (a drained cluster's are gone after a restart)
        bar = _Progress(self.progress)
        try:
            while True:
                self._drop_dead_spares()
                self._note_drained()
                self._note_joined()
                roots.update(self._grow())
                roots = {c: p for c, p in roots.items() if c not in self.drained}
                decided = supervising.decide_running(
                    self.plan, self.job.spec.run_policy, self._seen(), self.memory,
                    self._failure, rejoining=self.rejoining, drained=self.drained,
                    abandoned=self.abandoned,
                    recovered=(r["cluster"] for r in self.recoveries),
                    seconds_running=time.monotonic() - self._started, vanished_lost=False)
                if decided.ends is not None:
                    self._abandon(decided.ends)
                    continue  # (decided again without them)
                if decided.loss is not None or decided.done:
                    return decided
                if decided.past:
                    self.conditions = supervising.failed(
                        self.conditions, supervising.DEADLINE_EXCEEDED, decided.past, _now())
                    raise WorkerFailed(decided.past)
                if self.lease is not None and self.lease.lost:  # (another run writes there now)
                    self.conditions = supervising.failed(
                        self.conditions, "CheckpointFolderLost", self.lease.lost, _now())
                    raise WorkerFailed(self.lease.lost)
                self._rejoined(decided.back)
                if decided.up and (not jobstatus.is_true(self.conditions, "Running")
                                   or jobstatus.is_true(self.conditions, "Restarting")):
                    self.conditions = supervising.all_running(
                        self.conditions, "WorkersRunning",
                        f"{len(self.procs)} worker processes running", _now())
                    self.write_status(Phase.RUNNING, {})
                now = bar.update(roots, self._started)
                if now:
                    self.write_status(Phase.RUNNING, now)
                time.sleep(0.5)
        finally:
            bar.close()

    @staticmethod
    def _failure(down: Sequence[supervising.Seen]) -> str:
        """How a loss came about, in the local runner's words: the worker that ended first."""
        return f"worker {down[0].node} exited with code {down[0].ending.exit_code}"

    def _note_drained(self) -> None:
        """A cluster whose root acknowledged a drain order drained: the job goes on, and ends,
        without it (its workers may still be closing their links; how they exit does not
        matter any more)."""
        assert self.plan is not None
        folder = self.out / draining.DRAIN_DIR
        for name, why in draining.refused(folder).items():
            if name not in self.orders_refused:
                self.orders_refused.add(name)
                text = f"drain order {name} refused: {why}"
                self._say(jobstatus.set_condition(self.conditions, "Drained", False,
                                                  "NotApplied", text, _now()), text, logging.ERROR)
        for c in self.plan.clusters:
            if c.id in self.drained:
                continue
            said = draining.acknowledged(folder, c.id)
            if said is not None:
                self.drained[c.id] = {**said, **draining.order(folder, c.id)}
                log.warning("%s", elastic.drained_out(c.id, said.get("round"),
                                                      said.get("updates")))
                self.write_status(Phase.RUNNING, {})

    def _grow(self) -> dict[int, _Proc]:
        """Act on the new grow orders (`ravnest grow`): start the workers of the clusters they
        add, which join the running job (`growing`); the roots of those clusters. An order whose
        providers cannot form clusters of the job is refused, logged and in the status."""
        assert self.plan is not None
        roots: dict[int, _Proc] = {}
        for name, order in growing.orders(self.out / growing.GROW_DIR, self.grow_seen):
            self.grow_seen.add(name)
            self.grow_orders += 1
            try:
                if isinstance(order, SpecError):
                    raise order
                job, plan = growing.grown_plan(self.job, self.plan, order)
            except (PlanError, SpecError) as e:
                text = f"grow order {self.grow_orders} ({name}) refused: {e}"
                self._say(jobstatus.set_condition(self.conditions, "Grown", False, "NotApplied",
                                                  text, _now()), text, logging.ERROR)
                continue
            new = [n.name for n in plan.nodes if n.name not in self.plan.names()]
            metas = self._grown_metadata(job, plan, new)
            self.job, self.plan = job, plan
            (self.out / "plan.txt").write_text(plan.table() + "\n")
            self.start(metas, rejoin=True)
            added = sorted({plan.node(n).cluster for n in new})
            self.rejoining.update(added)
            self.grown.append({"providers": [plan.node(n).provider for n in new],
                               "clusters": added, "at": round(time.time(), 3)})
            roots.update({c: p for c in added for p in self.procs
                          if p.node == plan.clusters[c].nodes[0]})
            text = elastic.growing([plan.node(n).provider for n in new], added,
                                   f"by grow order {self.grow_orders}")
            self._say(jobstatus.set_condition(self.conditions, "Grown", True, "Joining", text,
                                              _now()), text)
        return roots

    def _grown_metadata(self, job: Job, plan: Plan, new: list[str]) -> list[NodeMetadata]:
        """The node metadata of the `new` nodes of a plan that grew, theirs on fresh ports, and
        every node's rewritten with the grown plan and addresses (`self.metas`, the files)."""
        base = self.metas[0]
        addresses, metrics_ports, ring_addresses = node_endpoints(
            new, {n: self.host(plan.node(n).provider) for n in new},
            base.ring_addresses is not None)
        every = {**base.addresses, **addresses}
        rings = {**base.ring_addresses, **ring_addresses} if (
            base.ring_addresses is not None and ring_addresses is not None) else None
        # the running nodes' metadata too: one restarted (alone, or with the whole job) takes
        # the new nodes into its rings; its running worker does not read it again
        self.metas = [replace(m, job=job, plan=plan, addresses=every, ring_addresses=rings)
                      for m in self.metas]
        for m in self.metas:
            m.save(self.out / "nodes" / f"{m.node}.json")
        metas = []
        for n in new:
            m = replace(base, job=job, plan=plan, node=n, addresses=every, listen=addresses[n],
                        metrics_port=metrics_ports[n],
                        tls_dir=self._certify(n, host_of(addresses[n])),
                        identity_file=self._identify(n), ring_addresses=rings,
                        ring_listen=rings[n] if rings else "")
            m.save(self.out / "nodes" / f"{n}.json")
            metas.append(m)
        self.metas.extend(metas)
        return metas

    def _identify(self, node: str) -> str:
        """Issue `node` its identity from the run's authority; the file it is in (its
        owner's only)."""
        path = (self.out / "identity" / f"{node}.json").resolve()
        self._authority.issue(node).save(path)
        return str(path)

    def _certify(self, node: str, host: str) -> str | None:
        """With TLS, issue `node` its certificate from the run's CA, for the loopback and the
        host it listens on; the folder it is in."""
        if self._ca is None:
            return None
        folder = (self.out / "tls" / identity(node)).resolve()
        issue(self._ca, node, ["localhost"], sorted({LOOPBACK, host})).save(folder)
        return str(folder)

    def _note_joined(self) -> None:
        """A cluster added to the running job whose root said it joined: noted (membership)."""
        assert self.plan is not None
        for c in self.plan.clusters[self.plan.planned:]:
            if c.id not in self.joined:
                said = growing.joined(self.out / draining.DRAIN_DIR, c.id)
                if said is not None:
                    self.joined[c.id] = {"cluster": c.id, **said}
                    log.warning("cluster %d joined the job after round %s", c.id,
                                said.get("round"))

    def _drop_dead_spares(self) -> None:
        """A spare whose process ended is no spare: logged, and left out from then on."""
        for name, p in list(self.spare_procs.items()):
            if p.popen.poll() is not None:
                del self.spare_procs[name]
                self.spares = [sp for sp in self.spares if sp.name != name]
                log.warning("spare %s exited with code %s; last lines of %s:\n%s", name,
                            p.popen.returncode, p.log, _tail(p.log, 5))

    def supervise(self, metas: list[NodeMetadata]) -> None:
        """Start the workers and, when one dies, do what `supervising.after_loss` says: restart
        its cluster alone, or every worker from the newest complete checkpoint (at most
        `backoffLimit` times), or fail the run (WorkerFailed)."""
        self.metas = list(metas)
        self.start(metas)
        while not (decided := self.wait()).done:
            after, down = decided.loss, decided.down
            assert after is not None
            dead = next(p for p in self.procs if p.node == down[0].node)
            if after.act == supervising.Act.RESTART_CLUSTER:
                self._recover(down, self.metas, after)
                continue
            if after.act == supervising.Act.WAIT:  # (`wait` ends the run without it once done)
                said = after.said()
                waiting = supervising.on_loss(self.conditions, after, said, _now())
                if waiting != self.conditions:
                    self._say(waiting, said)  # (said once)
                time.sleep(0.5)
                continue
            if after.act == supervising.Act.FAIL:
                self.conditions = supervising.on_loss(self.conditions, after, after.said(),
                                                      _now())
                raise WorkerFailed(f"{after.said()}; last lines of {dead.log}:\n"
                                   f"{_tail(dead.log)}")
            taken = self._reassign(down)
            self.stop()
            self.procs = []
            self.rejoining = set()
            self.memory = after.memory
            metas = self._not_drained(self.metas)
            planned = [m for m in metas if not m.plan.grown(m.plan.node(m.node).cluster)]
            step = checkpointing.latest(self.checkpoint_dir(), [m.node for m in planned])
            where = f"checkpoint at step {step}" if step is not None else "the start"
            said = after.said(elastic.taken_over(taken), resumes=f"resumes from {where}")
            self._say(supervising.on_loss(self.conditions, after, said, _now()), said,
                      phase=Phase.RESTARTING)
            self.start(metas)

    @property
    def restarts(self) -> int:
        """The whole restarts so far."""
        return self.memory.restarts

    def _seen_of(self, proc: _Proc) -> supervising.Seen:
        """A worker as its process shows it (how it ended: its termination message, else its
        log's last lines)."""
        assert self.plan is not None
        code = proc.popen.poll()
        return supervising.seen_in_process(proc.node, self.plan.node(proc.node).cluster, code,
                                           ending_of(proc.log, code, finished=True))

    def _seen(self) -> dict[str, supervising.Seen]:
        """Every node of the plan not drained, as its process shows it (Missing: none runs it)."""
        assert self.plan is not None
        procs = {p.node: p for p in self.procs}
        return {n.name: self._seen_of(procs[n.name]) if n.name in procs else
                supervising.Seen(n.name, n.cluster, supervising.NodePhase.MISSING)
                for n in self.plan.nodes if n.cluster not in self.drained}

    def _say(self, conditions: supervising.Conditions, message: str,
             level: int = logging.WARNING, phase: Phase = Phase.RUNNING) -> None:
        """Log `message`, take `conditions` as the run's, and write the status."""
        log.log(level, "%s", message)
        self.conditions = conditions
        self.write_status(phase, {})

    def _not_drained(self, metas: list[NodeMetadata]) -> list[NodeMetadata]:
        """The metadata of the nodes of the clusters that did not drain (a whole restart leaves
        the drained ones out, and tells the others they are gone: `GONE_ENV`)."""
        assert self.plan is not None
        plan = self.plan
        return [m for m in metas if plan.node(m.node).cluster not in self.drained]

    def _abandon(self, ends: supervising.EndsWithout) -> None:
        """End the run without the clusters `ends` names (`supervising.ends_without`: they cannot
        finish with the others, which have): the workers of those new to it are stopped, and the
        others' outputs are the job's (the final round averaged them)."""
        assert self.plan is not None
        mine = [p for p in self.procs if self.plan.node(p.node).cluster in ends.new]
        self.stop(mine)
        self.procs = [p for p in self.procs if p not in mine]
        self.abandoned |= ends.new
        self.rejoining -= ends.new
        self._say(supervising.on_ends_without(self.conditions, ends, _now()), ends.said())

    def _recover(self, down: Sequence[supervising.Seen], metas: list[NodeMetadata],
                 after: supervising.AfterLoss) -> None:
        """Restart only the cluster of the nodes `down` (`after`, from `supervising.after_loss`);
        a free hot spare that holds the stage of one of them takes it over."""
        assert self.plan is not None and after.cluster is not None
        cluster, mine = after.cluster, {n.name for n in self.plan.cluster_nodes(after.cluster)}
        procs = [p for p in self.procs if p.node in mine]
        # killed at once: they have nothing to save, and their ports are wanted back now
        self.stop(procs, grace=0)
        self.procs = [p for p in self.procs if p.node not in mine]
        self.memory = after.memory
        self.rejoining.add(cluster)
        self.recoveries.append({"cluster": cluster, "node": down[0].node,
                                "exitCode": down[0].ending.exit_code,
                                "at": round(time.time(), 3)})
        chosen = elastic.choose_spares(self.plan, [s.node for s in down if s.cluster == cluster],
                                       self._free_spares())
        taken = {node: spare.name for node, spare in chosen.items() if self._take_over(
            next(m for m in metas if m.node == node), cluster, spare)}
        said = after.said(elastic.taken_over(taken))
        self._say(supervising.on_loss(self.conditions, after, said, _now()), said)
        self.start([m for m in metas if m.node in mine and m.node not in taken], rejoin=True)

    def _rejoined(self, back: frozenset[int]) -> None:
        """The clusters restarted alone or added whose workers all run again (`back`) train with
        the others; once none is left rejoining, Recovering turns False, as in the operator."""
        if not back:
            return
        self.rejoining -= back
        self.conditions = supervising.on_back(self.conditions, back, self.rejoining, _now())
        self.write_status(Phase.RUNNING, {})

    def checkpoint_dir(self) -> Location:
        """Where the workers write checkpoints (relative paths: in the output folder)."""
        spec = self.job.spec
        return open_location(spec.checkpoint.path, spec.storage.options(), base=self.out.resolve())

    def write_status(self, phase: Phase, now: dict[str, Any], **extra: Any) -> None:
        """`status.json`: the run's status, a `JobStatus` as the operator writes a RavnestJob's
        (what `ravnest status <job>` shows). `extra`: more of its fields (result, outputs)."""
        plan = self.plan
        counts = [sum(r["cluster"] == c for r in self.recoveries)
                  for c in range(max((r["cluster"] for r in self.recoveries), default=-1) + 1)]
        fields: dict[str, Any] = {
            "phase": phase, "conditions": self.conditions or None, "progress": now or None,
            "startTime": jobstatus.timestamp(self._wall_start), "restarts": self.restarts,
            "recoveries": len(self.recoveries), "clusterRecoveries": counts or None,
            "lastFailures": self.memory.last_failures(),
            "spares": {sp.name: _spare_phase(self.spare_procs.get(sp.name))
                       for sp in self.spares} or None,
            "takeovers": {t["node"]: t["provider"] for t in self.takeovers} or None,
            "drained": [{k: d[k] for k in ("cluster", "providers", "orderedAt", "round",
                                           "updates") if k in d}
                        for d in self.drained.values()] or None,
            # told to drain, not drained: still on the way, or (the run succeeded) too late
            ("notDrained" if phase == Phase.SUCCEEDED else "draining"): self._pending_drains()
            or None,
            "abandoned": sorted(self.abandoned) or None,
            "rejoining": sorted(self.rejoining) or None,
            "grown": [{**g, "at": jobstatus.timestamp(g["at"])} for g in self.grown] or None,
            "joined": [{k: j[k] for k in ("cluster", "round") if k in j}
                       for j in self.joined.values()] or None,
            **extra}
        if plan:
            fields["clusters"] = supervising.clusters_active(
                plan, {*self.rejoining, *self.drained, *self.abandoned})
            fields["membership"] = elastic.membership(plan, self.drained.values(),
                                                      self.joined.values())
        if phase in FINISHED:
            fields["completionTime"] = jobstatus.timestamp(time.time())
        status = jobstatus.JobStatus.model_validate(fields)
        tmp = self.out / ".status.json.tmp"
        tmp.write_text(status.model_dump_json(exclude_none=True))
        os.replace(tmp, self.out / "status.json")

    def claim(self) -> None:
        """Take the output folder for this run (created if need be): refused while another run
        holds it; kept until `release` or the process ends, however it ends."""
        if self._lock is None:
            self._lock = lock_folder(self.out)

    def _close_spawner(self) -> None:
        """End the fork server (`_worker_process`), if one runs; the workers it forked go on, for
        `stop` to end."""
        if self._spawner is not None:
            self._spawner.close()
            self._spawner = None

    def release(self) -> None:
        """Let go of what the run holds: its fork server, its lease and its folder's lock."""
        self._close_spawner()
        if self.lease is not None:
            self.lease.release()
            self.lease = None
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def run(self) -> dict[str, Any]:
        """Plan, run and fuse the job; a folder another run holds is refused before planning.
        What the run writes is its owner's only (PRIVATE_UMASK while the run lasts)."""
        refuse_if_locked(self.out)
        previous = os.umask(PRIVATE_UMASK)
        try:
            return self._train()
        finally:
            self.release()
            os.umask(previous)

    def _train(self) -> dict[str, Any]:
        metas = self.prepare()
        self.resumed_from = checkpointing.latest(
            self.checkpoint_dir(), [m.node for m in metas], set_aside=False) or 0
        started = self._wall_start = time.time()
        self._started = time.monotonic()
        self.write_status(Phase.CREATED, {})
        try:
            self.supervise(metas)
        except BaseException as e:
            if not jobstatus.is_true(self.conditions, "Failed"):  # (else: said why already)
                self.conditions = supervising.failed(
                    self.conditions, type(e).__name__,
                    str(e).splitlines()[0] if str(e) else "", _now())
            self.write_status(Phase.FAILED, {})
            raise
        finally:
            self.stop()
            self._close_spawner()
        summary = self.finish(time.time() - started)
        for late in self._pending_drains():
            log.warning("%s", elastic.not_drained(late["cluster"]))
        done = final_progress({}, summary, summary["samples_per_second"])
        self.write_status(Phase.SUCCEEDED, done, result=summary, outputs=self.outputs)
        return summary

    def _pending_drains(self) -> list[dict[str, Any]]:
        """The drain orders (`ravnest drain`) of the clusters that did not drain (yet)."""
        folder = self.out / draining.DRAIN_DIR
        if self.plan is None or not folder.is_dir():
            return []
        return [draining.order(folder, c) for c in sorted(draining.ordered_clusters(folder))
                if c not in self.drained]

    def finish(self, seconds: float) -> dict[str, Any]:
        """Fuse and write the outputs (`finishing`) in the job's output location."""
        assert self.plan is not None
        where = finishing.output_location(self.job.spec, self.out.resolve())
        summary = finishing.finish(self.job, self.plan, where, seconds, self.resumed_from,
                                   [c.id for c in self.plan.clusters
                                    if c.id not in self.abandoned and c.id not in self.drained])
        self.outputs = finishing.outputs(where, summary)
        return summary


WORKER_BASE_BYTES = 400 * 2**20
"""Memory of one worker process before its stage: torch, grpc and ravnest imported take about
314 MB of private memory (measured), 400 MiB with its server and buffers."""


def memory_warning(plan: Plan, physical: int) -> str | None:
    """A warning when the plan's workers, estimated as their stages' training memory plus
    `WORKER_BASE_BYTES` each, would need more than `physical` bytes; None when they fit."""
    need = sum(n.memory_bytes for n in plan.nodes) + len(plan.nodes) * WORKER_BASE_BYTES
    if need <= physical:
        return None
    return (f"{len(plan.nodes)} workers need an estimated {need / 2**30:.3g} GiB (their stages "
            f"plus {WORKER_BASE_BYTES / 2**20:.0f} MiB per process), more than this machine's "
            f"{physical / 2**30:.3g} GiB of memory: the run may swap or be killed; use fewer "
            "providers (spec.providers)")


def _now() -> str:
    """The time now, as a status writes it."""
    return jobstatus.timestamp(time.time())


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def _spare_phase(proc: _Proc | None) -> str:
    """A hot spare's phase in the status: Running, Exited (stopped, or ended), or Missing."""
    if proc is None:
        return "Missing"
    return "Running" if proc.popen.poll() is None else "Exited"


def ending_of(log_file: Path, exit_code: int | None,
              finished: bool = False) -> termination.Ending:
    """How a local worker that logs to `log_file` ended: its exit code and termination message
    (`termination.of_local`), else, when it left none, its log's last lines (as the kubelet's
    FallbackToLogsOnError has it for a pod); with `finished`, when (its log's last write, as an
    RFC 3339 time). One still running (`exit_code` None) has not ended: nothing is read."""
    if exit_code is None:
        return termination.NOT_ENDED
    ending = termination.of_local(log_file, exit_code)
    if not ending.message.strip():
        ending = termination.Ending(exit_code, message=_tail(log_file, 5))
    if finished:
        with contextlib.suppress(OSError):
            at = dt.datetime.fromtimestamp(log_file.stat().st_mtime, dt.UTC)
            ending = replace(ending, finished_at=at.isoformat(timespec="microseconds"))
    return ending


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class _Progress:
    """A tqdm bar fed from the roots' metrics."""

    def __init__(self, enabled: bool) -> None:
        self.bar: Any = None
        self.enabled = enabled

    def update(self, roots: dict[int, _Proc], started: float) -> dict[str, Any]:
        """Scrape the roots; show and return the progress ({} until it is known)."""
        stats = []
        for p in roots.values():
            try:
                stats.append(scrape(p.metrics_port, host=p.host, timeout=0.5))
            except OSError:
                return {}
        if not stats or not stats[0].get("ravnest_total_steps"):
            return {}
        now = progress(stats, time.monotonic() - started)
        if not self.enabled:
            return now
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=now["totalSteps"], unit="step", dynamic_ncols=True,
                            desc="training")
        self.bar.n = now["step"]
        post = {"epoch": now["epoch"], "loss": f"{now.get('loss', float('nan')):.4f}",
                "samples/s": f"{now.get('samplesPerSecond', 0):.0f}"}
        if now.get("validationMetric"):
            post["val"] = f"{now['validationMetric']:.3f}"
        self.bar.set_postfix(post, refresh=False)
        self.bar.refresh()
        return now

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_job(job: Job, output_dir: str | Path, progress: bool = True,
            source: str | Path | None = None) -> dict[str, Any]:
    """Run a job locally, one worker process per provider; return its summary (`source`: the
    job file it came from)."""
    return LocalRun(job, output_dir, progress, source=source).run()
