"""One job's nodes as `NodeRuntime`s in threads of this process, against single-process PyTorch.

Each node is linked to its neighbours by loopback senders (`ravnest.comm.loopback`): the same
runtime code as over gRPC, without a server. Three stages of `DeepMLP` (a skip connection
crossing the middle one), microbatches, gradient accumulation over updates and a per-step
scheduler must give the weights and losses that plain training of the whole model on the same
batches gives; with two clusters, ring reducers injected over loopback links average every
update, which must equal training on both clusters' batches at once. On the CPU
(tests/unit/test_pipeline_inprocess.py) and on a CUDA device (tests/gpu), in fp32 and bf16.
"""

from __future__ import annotations

import copy
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from models import DeepMLP

from ravnest.comm.inboxes import Inbox
from ravnest.comm.loopback import Loopback
from ravnest.plan.partitioning import Profile, build_stage, profile
from ravnest.plan.plans import ClusterPlan, NodePlan, Plan, RingPlan
from ravnest.train.allreducing import RingReducer
from ravnest.train.devices import Placement
from ravnest.train.metrics import Identity, WorkerMetrics
from ravnest.train.runtime import Batch, Batches, NodeRuntime
from ravnest.train.settings import Settings

CPU = Placement()
"""The CPU in fp32."""
SEED = 11
BATCH = 8
MICROBATCHES = 2
UPDATE_FREQUENCY = 2
BATCHES = 6
"""Per epoch and cluster: three updates."""
EPOCHS = 2
LR, MOMENTUM = 0.05, 0.9
CUTS = ((0, 3), (3, 5), (5, 11))
"""DeepMLP's layers per stage: flatten..relu | h1, relu_1 | h2..head; `a` (relu's output) goes
from the root through the middle stage to the leaf's `add`."""
ROLES = ("root", "stem", "leaf")


def make_plan(prof: Profile, clusters: int) -> Plan:
    nodes, chains = [], []
    for c in range(clusters):
        chain = []
        for st, (start, end) in enumerate(CUTS):
            layers = prof.layers[start:end]
            name = f"node_{c * len(CUTS) + st}"
            chain.append(name)
            nodes.append(NodePlan(
                name=name, provider=len(nodes), cluster=c, stage=st, role=ROLES[st],
                start=start, end=end, first_layer=layers[0].name, last_layer=layers[-1].name,
                state=tuple(s for layer in layers for s in layer.state),
                params=sum(layer.params for layer in layers), memory_bytes=0, ram_gb=1.0,
                seconds_per_microbatch=0.0))
        chains.append(tuple(chain))
    rings = tuple(RingPlan(f"r{st}", tuple(chain[st] for chain in chains), nodes[st].state)
                  for st in range(len(CUTS)) if clusters > 1)
    return Plan(clusters=tuple(ClusterPlan(c, chain, 0.0) for c, chain in enumerate(chains)),
                nodes=tuple(nodes), rings=rings, model_bytes=0, memory_bytes=0,
                samples_per_second=0.0)


def data(clusters: int, per_epoch: int = BATCHES) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and labels by epoch, batch (`per_epoch` an epoch) and cluster."""
    gen = torch.Generator().manual_seed(SEED)
    shape = (EPOCHS, per_epoch, clusters, BATCH)
    return torch.randn(*shape, 1, 8, 8, generator=gen), torch.randint(0, 10, shape, generator=gen)


def batches(xs: torch.Tensor, ys: torch.Tensor, cluster: int) -> Batches:
    def train(epoch: int) -> Iterator[Batch]:
        for b in range(xs.shape[1]):
            yield (xs[epoch, b, cluster],), ys[epoch, b, cluster]

    def validation() -> Iterator[Batch]:
        yield (xs[0, 0, cluster],), ys[0, 0, cluster]

    return Batches(train=train, per_epoch=xs.shape[1], validation=validation)


def optimizer_of(params: list[torch.nn.Parameter]
                 ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.StepLR]:
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def reference(model: torch.nn.Module, xs: torch.Tensor, ys: torch.Tensor,
              placement: Placement = CPU, init_scale: float = 2.0**16
              ) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain training: each update accumulates UPDATE_FREQUENCY batches (every cluster's block)
    at 1/UPDATE_FREQUENCY of their mean loss each; returns the weights and each update's loss.
    On the placement's device, its forward passes and loss under its autocast; in fp16 with
    torch's GradScaler (from `init_scale`)."""
    model = model.to(placement.device)
    xs, ys = xs.to(placement.device), ys.to(placement.device)
    opt, scheduler = optimizer_of(list(model.parameters()))
    scaler = (torch.amp.GradScaler(placement.device.type, init_scale=init_scale)
              if placement.precision == "fp16" else None)
    losses = []
    for epoch in range(EPOCHS):
        for first in range(0, xs.shape[1], UPDATE_FREQUENCY):  # (an epoch's last may be short)
            opt.zero_grad()
            total = 0.0
            update = range(first, min(first + UPDATE_FREQUENCY, xs.shape[1]))
            for b in update:
                x, y = xs[epoch, b].flatten(0, 1), ys[epoch, b].flatten(0, 1)
                with placement.autocast():
                    loss = torch.nn.functional.cross_entropy(model(x), y) / len(update)
                (loss if scaler is None else scaler.scale(loss)).backward()
                total += loss.item()
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
            with warnings.catch_warnings():  # (GradScaler skipped the first step)
                warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step",
                                        UserWarning)
                scheduler.step()
            losses.append(total)
    return model.state_dict(), losses


def build(plan: Plan, gm: torch.nn.Module, xs: torch.Tensor, ys: torch.Tensor,
          placement: Placement = CPU, schedule: str = "sync",
          criterion: Any = torch.nn.functional.cross_entropy, **overrides: Any
          ) -> tuple[list[NodeRuntime], list[Loopback]]:
    """A runtime per node of `plan`, each with a loopback link to each node it sends to; ring
    reducers are built here and injected. Every stage on the placement's device, in its
    precision (the data stays in host memory, as a root's dataset does), the leaf's loss
    `criterion`. `overrides`: other `Settings` (reduce_factor, outer, compression: its ring
    reducers' own; scheduler_step_on, "step" unless given)."""
    settings = Settings(**{"epochs": EPOCHS, "batch_size": BATCH, "microbatches": MICROBATCHES,
                           "update_frequency": UPDATE_FREQUENCY, "schedule": schedule,
                           "scheduler_step_on": "step", "peer_timeout": 30.0,
                           "reduce_timeout": 30.0, "device": str(placement.device),
                           "precision": placement.precision, **overrides})
    inboxes = {n: Inbox() for n in plan.names()}
    models = [copy.deepcopy(gm).to(placement.device)  # stages share their model's modules
              for _ in plan.clusters]
    runtimes, links = [], []
    for me in plan.nodes:
        stage = build_stage(models[me.cluster], me.start, me.end)
        optimizer, scheduler = optimizer_of(list(stage.parameters()))
        to = {n for n in plan.neighbours(me.name) if n} | {r.successor(me.name)
                                                           for r in plan.rings_of(me.name)}
        peers = {n: Loopback(inboxes[n].deliver, f"{me.name}->{n}") for n in sorted(to)}
        links += peers.values()
        reducers = [RingReducer(r, me.name, peers, inboxes[me.name], settings.reduce_timeout,
                                compression=settings.compression)
                    for r in plan.rings_of(me.name)]
        metrics = WorkerMetrics(Identity("inprocess", "default", me.name, me.role, me.cluster,
                                         me.stage))
        runtimes.append(NodeRuntime(
            me.name, plan, stage, settings, optimizer, scheduler,
            criterion if me.is_leaf else None, inboxes[me.name], peers,
            metrics, batches(xs, ys, me.cluster) if me.is_root else None, reducers=reducers))
    return runtimes, links


def train(clusters: int, **options: Any
          ) -> tuple[list[NodeRuntime], torch.nn.Module, torch.Tensor, torch.Tensor]:
    """DeepMLP (seeded) trained over `clusters` clusters by `build(..., **options)`'s runtimes;
    the runtimes, the model as it was before and the data, for a reference to train."""
    torch.manual_seed(SEED)
    model = DeepMLP()
    initial = copy.deepcopy(model)
    gm, prof = profile(model, (torch.zeros(BATCH, 1, 8, 8),))
    xs, ys = data(clusters)
    runtimes, links = build(make_plan(prof, clusters), gm, xs, ys, **options)
    try:
        run(runtimes)
    finally:
        for link in links:
            link.close()
    return runtimes, initial, xs, ys


def run(runtimes: list[NodeRuntime]) -> None:
    """Every node's loop in a thread of its own, until all are done; raise the first failure."""
    errors: list[BaseException] = []

    def loop(rt: NodeRuntime) -> None:
        try:
            if rt.me.is_root:
                rt.drive()
            else:
                rt.serve()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=loop, args=(rt,), name=rt.name) for rt in runtimes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not [t.name for t in threads if t.is_alive()], "nodes still running"
    if errors:
        raise errors[0]


def check_against_single_process(clusters: int, placement: Placement = CPU,
                                 atol: float = 1e-5, init_scale: float = 2.0**16,
                                 input_gain: float = 1.0, per_epoch: int = BATCHES,
                                 **overrides: Any) -> list[NodeRuntime]:
    """Train the pipeline and the whole model alike (`placement`; in fp16 the loss scales from
    `init_scale`); the weights of every cluster and the mean training losses must agree within
    `atol`. The runtimes, trained. `input_gain`: the inputs times it and the first layer's
    weights over it (the same activations; the first layer's weight gradients that much
    larger, so that in fp16 they overflow first, in the root's stage). `per_epoch`: batches an
    epoch (not a multiple of UPDATE_FREQUENCY: each epoch ends with a short update).
    `overrides`: other `Settings` that must not change the outcome."""
    torch.manual_seed(SEED)
    model = DeepMLP()
    with torch.no_grad():
        model.inp.weight.div_(input_gain)
    initial = copy.deepcopy(model)
    gm, prof = profile(model, (torch.zeros(BATCH, 1, 8, 8),))
    plan = make_plan(prof, clusters)
    xs, ys = data(clusters, per_epoch)
    xs = xs * input_gain
    runtimes, links = build(plan, gm, xs, ys, placement, **overrides)
    for rt in runtimes:
        if rt.passes.loss_scale is not None:
            rt.passes.loss_scale.scale = init_scale
    try:
        run(runtimes)
    finally:
        for link in links:
            link.close()
    expected, losses = reference(initial, xs, ys, placement, init_scale)
    updates = EPOCHS * -(-per_epoch // UPDATE_FREQUENCY)
    assert [rt.updates for rt in runtimes] == [updates] * len(runtimes)
    assert sum(rt.rounds_skipped for rt in runtimes) == 0
    for c in range(clusters):
        trained = {k: v for rt in runtimes if rt.me.cluster == c
                   for k, v in rt.stage.stage_state_dict().items()}
        assert trained.keys() == expected.keys()
        for k, v in expected.items():
            torch.testing.assert_close(trained[k], v, rtol=0, atol=atol, msg=k)
    roots = [rt for rt in runtimes if rt.me.is_root]
    curves = [[r["train_loss"] for r in rt.curve.rows if "train_loss" in r] for rt in roots]
    got = [sum(per_cluster) / clusters for per_cluster in zip(*curves, strict=True)]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(losses), rtol=0, atol=atol)
    assert all(rt.curve.last_val_loss is not None for rt in roots)
    return runtimes
