"""The plan as a planner pod hands it to the operator, and the operator's checks on it.

The operator never runs code a job names: a planner pod of the job's own image plans the job
(`ravnest plan-pod`) and leaves the plan as its container's termination message, which the kubelet
hands to the API and needs no credentials to write. The message is a one-line header and the plan's
JSON, gzip-compressed and base64-encoded, so plans of hundreds of nodes fit Kubernetes' 4096 bytes
(a 48-block transformer over 16 providers: 46 kB of JSON, 3.6 kB of message).

The operator reads the message as data from a process it does not trust: every field's type is
checked, its size bounded, the nodes, clusters and rings must agree with each other and with the
job's providers, and the fingerprint must be the plan's content hashed with the job's identity.
Anything else is refused with a `PlanError` that says what.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
import zlib
from typing import Any

import pydantic

from ravnest import termination
from ravnest.errors import PlanError
from ravnest.plan.plans import Plan, fingerprint
from ravnest.spec import JobSpec

HEADER = "ravnest-plan/v1"
MESSAGE_LIMIT = termination.LIMIT
PLAN_LIMIT = 512 << 10
"""Bytes of plan JSON the operator takes at most: it is stored in the plan ConfigMap (1 MiB with
its table) and every node's."""
NAME_LIMIT = 256
"""Characters of a layer name the operator takes (they go into the job's status)."""
ROLES = ("root", "stem", "leaf", "root-leaf")
RING_ID = re.compile(r"^ring[0-9]{1,6}$")
"""A ring's id as the planner names it (`planning`): it goes into the plan's table and status."""
_PLAN = pydantic.TypeAdapter(Plan)


def identity(spec: JobSpec) -> dict[str, Any]:
    """What defines the model and its data, hashed into the plan fingerprint."""
    return {"model": spec.model.model_dump(mode="json"), "data": spec.data.model_dump(mode="json")}


def encode(plan: Plan) -> str:
    """The termination message that carries `plan`; PlanError when it would not fit."""
    packed = base64.b64encode(zlib.compress(plan.to_json().encode(), 9)).decode()
    message = f"{HEADER}\n{packed}"
    if len(message) > MESSAGE_LIMIT:
        raise PlanError(f"the plan of {len(plan.nodes)} nodes takes {len(message)} bytes "
                        f"compressed, more than the {MESSAGE_LIMIT} bytes of a termination "
                        f"message the planner pod hands it back in; use fewer providers")
    return message


def decode(message: str, spec: JobSpec) -> Plan:
    """The plan a planner pod's termination message carries, checked against the job."""
    if not message.startswith(HEADER + "\n"):
        raise PlanError(f"the planner's message does not start with {HEADER!r}")
    try:
        packed = base64.b64decode(message[len(HEADER) + 1:].strip(), validate=True)
        inflate = zlib.decompressobj()
        raw = inflate.decompress(packed, PLAN_LIMIT)
    except (binascii.Error, zlib.error) as e:
        raise PlanError(f"the planner's message is not a compressed plan ({e})") from e
    if inflate.unconsumed_tail:
        raise PlanError(f"the planner's plan is larger than {PLAN_LIMIT} bytes")
    try:
        plan = _PLAN.validate_json(raw, strict=True)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise PlanError(f"the planner's plan is malformed: plan.{where}: {first['msg']} "
                        f"({e.error_count()} problem(s))") from None
    check(plan, spec)
    return plan


def check(plan: Plan, spec: JobSpec) -> None:
    """Refuse a plan that does not fit the job: each problem named, PlanError."""
    problems = [*_node_problems(plan, len(spec.expanded_providers())),
                *_cluster_problems(plan, spec.plan.clusters), *_ring_problems(plan),
                *_figure_problems(plan)]
    if not problems and plan.fingerprint != fingerprint(plan, identity(spec)):
        problems.append(f"fingerprint {plan.fingerprint!r} is not this job's plan's")
    if problems:
        raise PlanError("the planner's plan does not fit the job: " + "; ".join(problems[:5])
                        + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))


def _node_problems(plan: Plan, providers: int) -> list[str]:
    out: list[str] = []
    seen: set[int] = set()
    for i, n in enumerate(plan.nodes):
        where = f"plan.nodes[{i}]"
        out += _provider_problems(where, n.name, "node", n.provider, providers, seen)
        if n.role not in ROLES:
            out.append(f"{where}.role: {n.role[:20]!r} is not one of {', '.join(ROLES)}")
        if not 0 <= n.start < n.end:
            out.append(f"{where}: layers {n.start}..{n.end} are not a range")
        if max(len(n.first_layer), len(n.last_layer)) > NAME_LIMIT:
            out.append(f"{where}: a layer name is longer than {NAME_LIMIT} characters")
        if any(len(name) > NAME_LIMIT for name in n.state) or len(set(n.state)) != len(n.state):
            out.append(f"{where}.state: a name longer than {NAME_LIMIT} characters, or twice")
    for i, sp in enumerate(plan.spares):
        out += _provider_problems(f"plan.spares[{i}]", sp.name, "spare", sp.provider, providers,
                                  seen)
    return out


def _provider_problems(where: str, name: str, kind: str, provider: int, providers: int,
                       seen: set[int]) -> list[str]:
    """A node's or spare's name and provider: `<kind>_<provider>`, one of the job's providers,
    and no provider twice (`seen`, which it adds to)."""
    out = []
    if name != f"{kind}_{provider}":
        out.append(f"{where}.name: {name[:40]!r} is not {kind}_<provider>")
    if not 0 <= provider < providers:
        out.append(f"{where}.provider: {provider} is not one of the job's {providers} providers")
    if provider in seen:
        out.append(f"{where}.provider: provider {provider} is a node or spare already")
    seen.add(provider)
    return out


def _cluster_problems(plan: Plan, wanted: int | None) -> list[str]:
    out: list[str] = []
    if wanted is not None and len(plan.clusters) != wanted:
        out.append(f"{len(plan.clusters)} clusters where spec.plan.clusters asks for {wanted}")
    nodes = {n.name: n for n in plan.nodes}
    placed: list[str] = []
    ends = set()
    for c_i, c in enumerate(plan.clusters):
        where = f"plan.clusters[{c_i}]"
        if c.id != c_i or not c.nodes:
            out.append(f"{where}: id {c.id} with {len(c.nodes)} nodes")
            continue
        members = [nodes[m] for m in c.nodes if m in nodes]
        if len(members) != len(c.nodes):
            out.append(f"{where}.nodes: names a node the plan does not have")
            continue
        placed.extend(c.nodes)
        last = len(members) - 1
        for s, n in enumerate(members):
            role = ("root-leaf" if last == 0 else "root" if s == 0 else
                    "leaf" if s == last else "stem")
            if (n.cluster, n.stage, n.role) != (c.id, s, role):
                out.append(f"{where}: {n.name} is cluster {n.cluster} stage {n.stage} "
                           f"{n.role}, not cluster {c.id} stage {s} {role}")
            if n.start != (members[s - 1].end if s else 0):
                out.append(f"{where}: {n.name}'s layers do not follow on from the stage before")
        ends.add(members[-1].end)
    if sorted(placed) != sorted(nodes) or len(placed) != len(plan.nodes):
        out.append("every node must be in exactly one cluster")
    if len(ends) > 1:
        out.append(f"the clusters end at different layers ({sorted(ends)})")
    return out


def _ring_problems(plan: Plan) -> list[str]:
    """Each ring: a planner's id, one node per cluster in cluster order, and state its members
    all hold."""
    nodes = {n.name: n for n in plan.nodes}
    ids = [r.id for r in plan.rings]
    out = []
    for i, r in enumerate(plan.rings):
        where = f"plan.rings[{i}]"
        if not RING_ID.match(r.id):
            out.append(f"{where}.id: {r.id[:20]!r} is not ring<number>")
        if not r.members:
            out.append(f"{where}.members: none")
            continue
        if not set(r.members) <= set(nodes) or len(set(r.members)) != len(r.members):
            out.append(f"{where}.members: not nodes of the plan")
            continue
        clusters = [nodes[m].cluster for m in r.members]
        if clusters != sorted(set(clusters)):
            out.append(f"{where}.members: not one node per cluster, in cluster order")
        if not r.state or any(not set(r.state) <= set(nodes[m].state) for m in r.members):
            out.append(f"{where}.state: not state its members hold")
    if len(set(ids)) != len(ids):
        out.append("plan.rings: two rings share an id")
    return out


def _figure_problems(plan: Plan) -> list[str]:
    """The estimates and sizes: finite and not negative (they go into the job's status); a
    planner's plan has no clusters added since (`planned_clusters` is the operator's)."""
    figures = {"model_bytes": plan.model_bytes, "memory_bytes": plan.memory_bytes,
               "samples_per_second": plan.samples_per_second,
               **{f"nodes[{i}].{k}": getattr(n, k) for i, n in enumerate(plan.nodes)
                  for k in ("params", "memory_bytes", "ram_gb", "seconds_per_microbatch")},
               **{f"clusters[{i}].seconds_per_batch": c.seconds_per_batch
                  for i, c in enumerate(plan.clusters)},
               **{f"spares[{i}].ram_gb": sp.ram_gb for i, sp in enumerate(plan.spares)}}
    out = [f"plan.{k}: {v!r} is not a finite figure of 0 or more" for k, v in figures.items()
           if not (math.isfinite(v) and v >= 0)]
    if plan.planned_clusters:
        out.append(f"plan.planned_clusters: {plan.planned_clusters} (a plan handed back has "
                   f"no clusters added to it)")
    if len(plan.kept_whole) > len(plan.nodes) * 1000 or any(
            len(a) > NAME_LIMIT or len(b) > NAME_LIMIT for a, b in plan.kept_whole):
        out.append(f"plan.kept_whole: more than 1000 entries a node, or a name or reason "
                   f"longer than {NAME_LIMIT} characters")
    return out
