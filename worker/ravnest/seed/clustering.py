"""The seed API's `clusterize`: plan a model over `node_data/node_configs.json`.

It reads the providers the way Ravnest does (``{"0": {"IP": "host:port", "benchmarks": {"ram": 8,
"bandwidth": 20}}}``), plans clusters and stages, and writes one metadata file per provider into
``node_data/nodes/`` plus each provider's stage module, so that a provider script only needs
``Node(name='node_3', ...)``. It also writes a random job token (mode 0600) that every provider
of the plan presents to its peers, and each provider's identity (``node_data/identity/<node>.json``,
mode 0600: its key and a certificate from a key made for this plan alone and never written), by
which it proves to its peers which node it is. Give each provider its own identity file only. The
metadata is the workers' (`ravnest.run.metadata`).

Every root of the seed API reads the same train_loader, so clusters would train on identical
data: by default `clusterize` forms one cluster of all the providers (as Ravnest does for equal
providers); `clusters=N` asks for N clusters, each training on the whole loader, averaged by
the rings. It prints each provider's cluster, role, address, neighbours and rings, then the plan.

By default a provider listens on the address `node_configs.json` gives it, and only there (ring
pieces over gRPC, as in Ravnest); `Node(listen_host='0.0.0.0')` listens on every interface (a
provider behind NAT, whose configured address is not its own). With `ring_transport='tcp'` (the
ring data plane, a job's default) each provider's ring server listens one port above its gRPC
port, which must be free and reachable.
With `tls=True` a CA made for this plan alone issues every provider a certificate into
``node_data/tls/<node>/`` (the CA's own key is never written).
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ravnest.comm.identity import Authority
from ravnest.comm.tls import identity, issue, make_authority
from ravnest.errors import PlanError, SpecError
from ravnest.plan.costs import Workload
from ravnest.plan.partitioning import build_stage, profile
from ravnest.plan.planning import make_plan
from ravnest.plan.plans import Plan, ProviderInfo
from ravnest.run.metadata import NodeMetadata, host_of, ring_address
from ravnest.seed.arguments import Arguments
from ravnest.seed.console import say
from ravnest.spec import SecuritySpec, TrainingSpec, parse_section


def read_node_configs(path: str | Path) -> tuple[list[str], list[ProviderInfo]]:
    """Addresses and provider specs from a Ravnest node_configs.json, in node-id order."""
    p = Path(path)
    try:
        raw = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise SpecError([f"{p}: cannot read node configs ({e})"]) from e
    if not isinstance(raw, dict) or not raw:
        raise SpecError([f"{p}: must map node ids to {{'IP': ..., 'benchmarks': ...}}"])
    addresses, pool = [], []
    for key in sorted(raw, key=lambda k: int(k) if str(k).isdigit() else -1):
        if not str(key).isdigit():
            raise SpecError([f"{p}: [{key!r}]: node ids must be 0, 1, 2, ..."])
        entry = raw[key]
        where = f"{p}: [{key!r}]"
        try:
            ip = str(entry["IP"])
            bench = entry["benchmarks"]
            ram = float(bench["ram"])
            bandwidth = float(bench["bandwidth"]) if "bandwidth" in bench else None
            compute = float(bench.get("compute", 1.0))
        except (KeyError, TypeError, ValueError) as e:
            raise SpecError([f"{where}: needs IP and benchmarks.ram (GB) ({e!r})"]) from e
        if ram <= 0 or (bandwidth is not None and bandwidth <= 0) or compute <= 0:
            raise SpecError([f"{where}.benchmarks: ram, bandwidth and compute must be positive"])
        addresses.append(ip)
        pool.append(ProviderInfo(ram, bandwidth, compute))
    if [int(k) for k in sorted(raw, key=int)] != list(range(len(raw))):
        raise SpecError([f"{p}: node ids must be 0..{len(raw) - 1} without gaps"])
    return addresses, pool


def clusterize(model: nn.Module | None = None, example_args: tuple[Any, ...] = (),
               example_kwargs: dict[str, Any] | None = None, pass_data: bool = False,
               node_data: str | Path = "node_data", clusters: int | None = None,
               batch_size: int | None = None, microbatches: int = 1,
               optimizer: str = "Adam",
               ring_transport: str = "grpc",
               tls: bool = SecuritySpec().tls) -> Plan:
    """Form clusters, split the model and write node metadata into ``node_data/nodes/``.

    `pass_data` is accepted for compatibility: the model is always run once on the example input
    (to trace it and size activations). `clusters`: how many clusters (default one, see the
    module's docstring). `ring_transport` and `tls` mean what a job's training.ringTransport and
    security.tls do; the seed API's default is `grpc`, so a provider needs no port beyond the one
    `node_configs.json` names. Returns the plan (also printed).
    """
    given = Arguments("clusterize")
    given.model("model", model)
    given.inputs("example_args", example_args)
    if example_kwargs:
        given.problems.append("clusterize: example_kwargs are not supported; pass inputs "
                              "positionally in example_args")
    given.flag("pass_data", pass_data)
    given.path("node_data", node_data)
    given.whole("clusters", clusters, optional=True)
    given.whole("batch_size", batch_size, optional=True)
    given.whole("microbatches", microbatches)
    given.optimizer_name("optimizer", optimizer)
    given.flag("tls", tls)
    given.check()
    training = parse_section(TrainingSpec, {"ringTransport": ring_transport})
    assert model is not None
    root = Path(node_data)
    addresses, pool = read_node_configs(root / "node_configs.json")
    address_map = {f"node_{i}": a for i, a in enumerate(addresses)}
    ring_map = ({n: ring_address(a) for n, a in address_map.items()}
                if training.ring_transport == "tcp" else None)
    _check_ring_ports(address_map, ring_map)
    gm, prof = profile(model, [a for a in example_args if isinstance(a, torch.Tensor)])
    bsz = batch_size or prof.example_batch
    work = Workload(batch_size=bsz, microbatches=microbatches, optimizer=optimizer)
    plan = _plan(prof, pool, work, clusters, type(model).__name__)
    nodes_dir = root / "nodes"
    nodes_dir.mkdir(parents=True, exist_ok=True)
    _write_token(root / "token")
    tls_dirs = _certificates(root / "tls", address_map) if tls else {}
    _identify(root / "identity", plan)
    for n in plan.nodes:
        stage = build_stage(gm, n.start, n.end)
        torch.save(stage, nodes_dir / f"{n.name}.submodel.pt")
        mine = address_map[n.name]
        NodeMetadata(plan=plan, node=n.name, addresses=address_map, listen=mine,
                     tls_dir=tls_dirs.get(n.name), ring_addresses=ring_map,
                     ring_listen=ring_address(mine),
                     microbatches=microbatches,
                     identity_file=str(root / "identity" / f"{n.name}.json"),
                     ).save(nodes_dir / f"{n.name}.json")
    _show(plan, address_map)
    return plan


def _plan(prof: Any, pool: list[ProviderInfo], work: Workload, clusters: int | None,
          model_name: str) -> Plan:
    """One cluster unless `clusters` says otherwise, with what to do when it cannot be."""
    try:
        return make_plan(prof, pool, work, clusters=clusters or 1,
                         identity={"seed-api": model_name})
    except PlanError as e:
        if clusters is not None:
            raise
        raise PlanError(f"{e}. clusterize forms one cluster of all {len(pool)} providers unless "
                        f"told otherwise (every cluster's root reads the same train_loader, so "
                        f"more clusters train on identical data); pass clusters=N to form N "
                        f"clusters anyway, or list fewer providers in node_configs.json") from e


def _show(plan: Plan, addresses: dict[str, str]) -> None:
    """Each provider's place, as Ravnest's clusterize prints it, then the plan's table."""
    for n in plan.nodes:
        up, down = plan.neighbours(n.name)
        rings = {r.id: r.state[0] for r in plan.rings_of(n.name)}
        say(f"Node({n.name.removeprefix('node_')}, Cluster({n.cluster})) {n.role:<4} "
              f"self.IP({addresses[n.name]}) forward->{down or '-'} backward->{up or '-'} "
              f"rings={rings}")
    say(plan.table())


def _check_ring_ports(addresses: dict[str, str], rings: dict[str, str] | None) -> None:
    """Refuse ring data ports that are another provider's gRPC address (consecutive ports on one
    host, as Ravnest's local examples use)."""
    taken = {a: n for n, a in addresses.items()}
    clashes = [f"{n}'s ring port {a} is {taken[a]}'s address" for n, a in (rings or {}).items()
               if a in taken]
    if clashes:
        raise SpecError([f"node_configs.json: with ring_transport='tcp' each provider's ring "
                         f"server listens one port above its own; {'; '.join(clashes)} (space "
                         f"the ports out, or keep ring_transport='grpc')"])


def _write_token(path: Path) -> None:
    """The job's token, readable by its owner only (kept if there is one)."""
    if not path.exists():
        path.write_text(secrets.token_hex(16))
        os.chmod(path, 0o600)


def _identify(folder: Path, plan: Plan) -> None:
    """Each node's identity, `<node>.json`, from an authority made for this plan alone."""
    authority = Authority.fresh()
    for n in plan.nodes:
        authority.issue(n.name).save(folder / f"{n.name}.json")


def _certificates(folder: Path, addresses: dict[str, str]) -> dict[str, str]:
    """A fresh CA issues each node a certificate naming its identity and its host; node -> the
    folder that holds its CA certificate, certificate and key."""
    ca = make_authority("seed")
    dirs = {}
    for node, address in addresses.items():
        host = host_of(address)
        try:
            ipaddress.ip_address(host)
            names, ips = [], [host]
        except ValueError:
            names, ips = [host], []
        issue(ca, node, names, ips).save(folder / identity(node))
        dirs[node] = str(folder / identity(node))
    return dirs
