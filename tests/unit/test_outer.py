"""Outer optimizers on the rings (DiLoCo, `training.outer`, train/outer.py): pipelines of two
clusters in one process (tests/inprocess.py) against single-process PyTorch as ground truth, and
the outer state a checkpoint and a rejoin carry."""

from __future__ import annotations

import copy
import io
import json

import pytest
import torch
from handover import node, train_step
from inprocess import (
    BATCH,
    BATCHES,
    EPOCHS,
    SEED,
    UPDATE_FREQUENCY,
    build,
    check_against_single_process,
    data,
    make_plan,
    optimizer_of,
    run,
)
from models import DeepMLP

from ravnest.errors import RavnestError, SpecError
from ravnest.plan.partitioning import profile
from ravnest.spec import OuterSpec, TrainingSpec, parse_section
from ravnest.train.messages import State, parse
from ravnest.train.outer import OuterStep, outer_steps
from ravnest.train.rejoining import pack_state, unpack_state

NESTEROV = OuterSpec(optimizer="nesterov", lr=0.7, momentum=0.9)


def test_outer_sgd_with_lr_1_and_no_momentum_is_the_plain_mean() -> None:
    """Two clusters averaging every update through outer SGD (lr 1, no momentum) train as one
    process on both clusters' batches does, as the plain mean does."""
    runtimes = check_against_single_process(
        2, outer=OuterSpec(optimizer="sgd", lr=1.0, momentum=0.0))
    assert all(rt.outer for rt in runtimes)  # (every stage has parameters in a ring)


def diloco(model: torch.nn.Module, xs: torch.Tensor, ys: torch.Tensor, every: int,
           spec: OuterSpec) -> dict[str, torch.Tensor]:
    """DiLoCo in one process: each cluster's replica trains on its own batches with its own
    inner optimizer; every `every` updates the mean pseudo-gradient takes one outer step of the
    replicas' common start, which they all restart from; at the end, the mean of the replicas."""
    clusters = xs.shape[2]
    replicas = [copy.deepcopy(model) for _ in range(clusters)]
    inner = [optimizer_of(list(r.parameters())) for r in replicas]
    start = copy.deepcopy(model)
    outer = torch.optim.SGD(start.parameters(), lr=spec.lr, momentum=spec.momentum,
                            nesterov=spec.optimizer == "nesterov")
    updates = 0
    for epoch in range(EPOCHS):
        for first in range(0, xs.shape[1], UPDATE_FREQUENCY):
            update = range(first, min(first + UPDATE_FREQUENCY, xs.shape[1]))
            for c, (replica, (opt, scheduler)) in enumerate(zip(replicas, inner, strict=True)):
                opt.zero_grad()
                for b in update:
                    loss = torch.nn.functional.cross_entropy(
                        replica(xs[epoch, b, c]), ys[epoch, b, c]) / len(update)
                    loss.backward()
                opt.step()
                scheduler.step()
            updates += 1
            if updates % every == 0:
                for p, *own in zip(start.parameters(), *(r.parameters() for r in replicas),
                                   strict=True):
                    p.grad = torch.stack([p.detach() - q.detach() for q in own]).mean(0)
                outer.step()
                for r in replicas:
                    r.load_state_dict(start.state_dict())
    states = [r.state_dict() for r in replicas]
    return {k: torch.stack([s[k] for s in states]).mean(0) for k in states[0]}


def two_clusters(**overrides: object) -> tuple[list, tuple]:
    """DeepMLP's pipelines in two clusters trained in one process with `overrides` (Settings);
    the runtimes, and (the initial model, the plan, its graph module, the data)."""
    torch.manual_seed(SEED)
    model = DeepMLP()
    initial = copy.deepcopy(model)
    gm, prof = profile(model, (torch.zeros(BATCH, 1, 8, 8),))
    plan = make_plan(prof, 2)
    xs, ys = data(2)
    runtimes, links = build(plan, gm, xs, ys, **overrides)
    try:
        run(runtimes)
    finally:
        for link in links:
            link.close()
    return runtimes, (initial, plan, gm, xs, ys)


@pytest.mark.parametrize("every", [2, 4])
def test_nesterov_outer_steps_every_h_updates_follow_single_process_diloco(every: int) -> None:
    """reduceFactor H with a Nesterov outer optimizer: the weights of both clusters' pipelines
    are those of DiLoCo in one process. H 2: three outer steps (momentum at work), the last at
    the job's last update, so the final round must change nothing; H 4: one outer step, then
    two updates the final round averages."""
    runtimes, (initial, plan, gm, xs, ys) = two_clusters(reduce_factor=every, outer=NESTEROV)
    expected = diloco(initial, xs, ys, every, NESTEROV)
    assert {rt.updates for rt in runtimes} == {EPOCHS * BATCHES // UPDATE_FREQUENCY}
    assert sum(rt.rounds_skipped for rt in runtimes) == 0
    plain = diloco(initial, xs, ys, every, OuterSpec(optimizer="sgd", lr=1.0, momentum=0.0))
    assert max((plain[k] - expected[k]).abs().max().item() for k in expected) > 1e-3
    for c in range(2):
        trained = {k: v for rt in runtimes if rt.me.cluster == c
                   for k, v in rt.stage.stage_state_dict().items()}
        assert trained.keys() == expected.keys()
        for k, v in expected.items():
            torch.testing.assert_close(trained[k], v, rtol=0, atol=2e-5, msg=k)
    if every == 2:
        return
    # each node's checkpoint (as Checkpoints writes and reads it) holds its rings' outer state:
    # nodes made afresh and resumed from it hold the same anchors and momentum
    again, links = build(plan, gm, xs, ys, reduce_factor=every, outer=NESTEROV)
    for link in links:
        link.close()
    for rt, fresh in zip(runtimes, again, strict=True):
        buf = io.BytesIO()
        torch.save(rt.state(), buf)
        fresh.load_state(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
        (ring,) = rt.outer
        saved, loaded = rt.outer[ring].tensors(), fresh.outer[ring].tensors()
        assert saved.keys() == loaded.keys() and all("momentum_buffer" in v for v in saved.values())
        for n in saved:
            for key in saved[n]:
                torch.testing.assert_close(loaded[n][key], saved[n][key], rtol=0, atol=0)


def test_a_skipped_round_leaves_the_parameters_and_the_next_covers_both_intervals() -> None:
    weights = [torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0])]
    steps = [OuterStep(OuterSpec(optimizer="sgd", lr=1.0, momentum=0.0), {"w": w})
             for w in weights]

    def round_(done: bool) -> None:
        deltas = [s.pseudo_gradients()[0] for s in steps]
        mean = torch.stack(deltas).mean(0)
        for s, d in zip(steps, deltas, strict=True):
            if done:
                d.copy_(mean)
                s.step()
            else:
                s.dropped()

    weights[0] += torch.tensor([1.0, 0.0])
    weights[1] += torch.tensor([0.0, 4.0])
    round_(done=False)
    assert weights[0].tolist() == [2.0, 2.0] and weights[1].tolist() == [1.0, 6.0]
    weights[0] += torch.tensor([1.0, 0.0])
    round_(done=True)
    assert weights[0].tolist() == weights[1].tolist() == [2.0, 4.0]  # mean of [3, 2], [1, 6]
    with pytest.raises(RavnestError, match="pseudo-gradients"):
        steps[0].step()  # (no round in progress)


def _trained_outer() -> tuple[OuterStep, torch.nn.Module]:
    """A stage's outer step after two rounds of a node alone (momentum made)."""
    stage, optimization = node(1)
    (step,) = outer_steps(NESTEROV, stage, [("r0", tuple(stage.stage_state_dict()))]).values()
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        train_step(stage, optimization, torch.randn(5, 6, generator=g),
                   torch.randint(0, 3, (5,), generator=g))
        step.pseudo_gradients()
        step.step()
    return step, stage


def test_outer_steps_cover_a_rings_parameters_only_and_need_a_spec() -> None:
    stage, _ = node(1)
    state = stage.stage_state_dict(keep_vars=True)
    params = dict(stage.named_parameters())
    assert outer_steps(None, stage, [("r0", tuple(state))]) == {}
    (step,) = outer_steps(NESTEROV, stage, [("r0", tuple(state))]).values()
    assert set(step.names) == {n for n in state if f"graph_module.{n}" in params}
    assert "bn.running_mean" in state and "bn.running_mean" not in step.names


def test_the_outer_state_survives_a_checkpoint() -> None:
    """What `NodeRuntime.state` keeps of an outer step, through torch.save and back into a
    fresh one (another initialisation), gives the same next step."""
    step, stage = _trained_outer()
    buf = io.BytesIO()
    torch.save(step.tensors(), buf)
    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    other_stage, _ = node(2)
    (other,) = outer_steps(NESTEROV, other_stage,
                           [("r0", tuple(other_stage.stage_state_dict()))]).values()
    other_stage.graph_module.load_state_dict(stage.graph_module.state_dict())
    other.load(saved, "checkpoint")
    _same_next_step(step, stage, other, other_stage)


def test_the_outer_state_goes_with_a_rings_state_to_a_rejoining_node() -> None:
    """`pack_state` with an outer step: the joiner (another initialisation) loads the anchors and
    the momentum, and both take the same next outer step; a joiner that expects outer state
    and gets none is refused, and one without an outer optimizer ignores it."""
    step, stage = _trained_outer()
    _, optimization = node(1)
    names = tuple(stage.stage_state_dict())
    tensors, control = pack_state(stage, optimization, names, step)
    assert any(k.startswith("u/") and k.endswith("/momentum_buffer") for k in tensors)
    control = json.loads(json.dumps(control))
    reply = parse({"op": "state", "ring": "r0", "round": 2, "updates": 2, **control})
    assert isinstance(reply, State)
    joiner, join_opt = node(2)
    (joined,) = outer_steps(NESTEROV, joiner, [("r0", names)]).values()
    nbytes = unpack_state(joiner, join_opt, names, {k: v.clone() for k, v in tensors.items()},
                          reply, joined)
    assert nbytes > 3 * sum(p.numel() * 4 for p in stage.parameters())  # params, anchor, buf
    _same_next_step(step, stage, joined, joiner)
    bare = {k: v for k, v in tensors.items() if not k.startswith("u/")}
    with pytest.raises(RavnestError, match=r"rejoin: no outer state for .*training\.outer"):
        unpack_state(joiner, join_opt, names, bare, reply, joined)
    plain, plain_opt = node(3)
    unpack_state(plain, plain_opt, names, tensors, reply)  # (no outer step: ignored)


def _same_next_step(a: OuterStep, a_stage, b: OuterStep, b_stage) -> None:
    with torch.no_grad():
        for stage in (a_stage, b_stage):
            for p in stage.parameters():
                p.add_(0.01)
    for s in (a, b):
        s.pseudo_gradients()
        s.step()
    x, y = a_stage.stage_state_dict(), b_stage.stage_state_dict()
    for k in a.names:
        torch.testing.assert_close(y[k], x[k], rtol=0, atol=1e-7, msg=k)


@pytest.mark.parametrize(("outer", "message"), [
    ({"momentum": 0}, "outer: nesterov needs a momentum above 0"),
    ({"optimizer": "adam"}, "outer.optimizer: must be 'nesterov' or 'sgd'"),
    ({"lr": 0}, "outer.lr: must be greater than 0"),
    ({"lr": 0.7, "beta": 1}, "outer.beta"),
])
def test_a_bad_outer_optimizer_is_refused_with_its_path(outer, message) -> None:
    with pytest.raises(SpecError, match=message):
        parse_section(TrainingSpec, {"outer": outer})
