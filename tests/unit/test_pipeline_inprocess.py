"""The pipeline's sync schedule in one process, against single-process PyTorch as ground truth
(the harness: tests/inprocess.py), and the loopback links it runs on."""

from __future__ import annotations

import pytest
import torch
from inprocess import (
    BATCH,
    SEED,
    UPDATE_FREQUENCY,
    build,
    check_against_single_process,
    data,
    make_plan,
    reference,
    run,
    train,
)
from models import DeepMLP

from ravnest.comm.framing import Frame
from ravnest.comm.inboxes import Inbox
from ravnest.comm.loopback import Loopback
from ravnest.errors import PeerFailed, PeerTimeout, RavnestError, TransportError
from ravnest.plan.partitioning import profile
from ravnest.train.devices import Placement
from ravnest.train.messages import Kind, Op
from ravnest.train.pipelining import batch_samples_of


@pytest.mark.parametrize("clusters", [1, 2])
def test_sync_pipeline_in_one_process_equals_single_process_training(clusters: int) -> None:
    check_against_single_process(clusters)


def test_the_seed_apis_loss_is_used_as_given_once_per_batch() -> None:
    """Issue 38 item 5: Ravnest's provider template tells users to divide their loss by the
    update frequency themselves, and the engine divided again (steps N times too small). Under
    the seed API (`loss_as_given`, which its Trainer sets) a batch's loss counts as the
    criterion gives it: a criterion that divides by the update frequency, as the seed says,
    trains what whole-model training on the update's mean trains."""
    def divided(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(output, target) / UPDATE_FREQUENCY

    runtimes, initial, xs, ys = train(1, criterion=divided, loss_as_given=True)
    expected, _ = reference(initial, xs, ys)
    trained = {k: v for rt in runtimes for k, v in rt.stage.stage_state_dict().items()}
    for k, v in expected.items():
        torch.testing.assert_close(trained[k], v, rtol=0, atol=1e-5, msg=k)


def test_bf16_pipeline_equals_single_process_training_under_the_same_autocast() -> None:
    """precision bf16 on the CPU: the stages' forwards run under autocast, and what crosses
    from stage to stage is bf16; the weights stay fp32 and follow whole-model training under
    the same autocast."""
    runtimes = check_against_single_process(1, Placement(precision="bf16"), atol=1e-3)
    assert all(p.dtype == torch.float32 for rt in runtimes for p in rt.stage.parameters())
    root = next(rt for rt in runtimes if rt.me.is_root)
    x = torch.zeros(BATCH, 1, 8, 8)
    with root.passes.placement.autocast():
        out = root.stage(**{root.stage.input_names[0]: x})
    assert {t.dtype for t in out.values()} == {torch.bfloat16}


def test_loopback_hands_ordered_frames_on_in_order_and_snapshots_tensors() -> None:
    inbox = Inbox(capacity=256)
    link = Loopback(inbox.deliver)
    try:
        t = torch.zeros(3)
        for i in range(100):
            t.fill_(i)
            link.post(Frame("forward", {"x": t}, microbatch=i, control={"i": i}))
        link.flush(5)
        for i in range(100):
            frame = inbox.pipeline.get_nowait()
            assert (frame.microbatch, frame.control, frame.sequence) == (i, {"i": i}, i + 1)
            assert torch.equal(frame.tensors["x"], torch.full((3,), float(i)))
    finally:
        link.close()


def test_loopback_reports_a_refused_frame_on_the_next_call() -> None:
    link = Loopback(Inbox().deliver)
    try:
        link.post(Frame("nonsense"))
        with pytest.raises(TransportError, match="unknown frame kind"):
            link.flush(5)
        link.post(Frame("control", control={"op": "finish"}))
        link.flush(5)
    finally:
        link.close()


@pytest.mark.parametrize("finished", [True, False])
def test_a_rejoining_node_takes_no_neighbour_ended_after_finish_for_a_loss(finished: bool
                                                                           ) -> None:
    """A cluster that rejoins for the final state: its root passes `finish` on and ends, while
    its next node still waits for its ring's state. The root's end (an abort from the watch)
    is no failure once `finish` came before it; without `finish` it is."""
    torch.manual_seed(SEED)
    gm, prof = profile(DeepMLP(), (torch.zeros(BATCH, 1, 8, 8),))
    plan = make_plan(prof, 2)
    xs, ys = data(2)
    runtimes, links = build(plan, gm, xs, ys)
    node = next(rt for rt in runtimes if rt.me.cluster == 1 and rt.me.stage == 1)
    root = plan.clusters[1].nodes[0]
    try:
        if finished:
            node.inbox.deliver(Frame(Kind.CONTROL, sender=root, control={"op": Op.FINISH}))
        node.inbox.deliver(Frame(Kind.CONTROL, sender=root, control={
            "op": Op.ABORT, "node": root, "error": "it was lost: it began shutting down"}))
        with pytest.raises(PeerTimeout if finished else PeerFailed):
            node.members.await_controls((Op.STATE,), 1.0)
    finally:
        for link in links:
            link.close()


@pytest.mark.parametrize("clusters", [1, 2])
def test_fp16_pipeline_follows_single_process_training_with_torchs_grad_scaler(clusters):
    """precision fp16: the leaf scales the loss, every stage unscales its gradients by the scale
    the backward frames carry, and the weights follow whole-model training under the same
    autocast with torch's GradScaler."""
    runtimes = check_against_single_process(clusters, Placement(precision="fp16"), atol=2e-3)
    assert not any(rt.optimization.overflows for rt in runtimes)
    assert {rt.passes.loss_scale.scale for rt in runtimes if rt.me.is_leaf} == {2.0**16}


def test_fp16_an_overflow_that_begins_in_the_roots_stage_is_skipped_by_every_stage():
    """The first layer's weight gradients overflow fp16 while every later stage's are finite
    (inputs 100 times larger, its weights 100 times smaller): every stage drops those updates,
    as GradScaler drops the whole model's step, and the leaf backs off once for each. (Before,
    the stages after the root had stepped already, and the leaf was never told.)"""
    runtimes = check_against_single_process(1, Placement(precision="fp16"), atol=2e-3,
                                            input_gain=100)
    skipped = {rt.name: rt.optimization.overflows for rt in runtimes}
    assert len(set(skipped.values())) == 1 and min(skipped.values()) >= 1, skipped
    leaf = next(rt for rt in runtimes if rt.me.is_leaf)
    assert leaf.passes.loss_scale.scale == 2.0**16 / 2 ** skipped[leaf.name]


def test_fp16_async_an_overflow_that_begins_in_the_roots_stage_backs_the_leafs_scale_off():
    """The async schedule steps each stage at once: the root drops the updates its own
    gradients overflowed, the stages after it have stepped them, and the leaf halves its loss
    scale after each, told so by the root's next forward. (Before, it was never told.)"""
    torch.manual_seed(SEED)
    model = DeepMLP()
    with torch.no_grad():
        model.inp.weight.div_(100)
    gm, prof = profile(model, (torch.zeros(BATCH, 1, 8, 8),))
    xs, ys = data(1)
    runtimes, links = build(make_plan(prof, 1), gm, xs * 100, ys, Placement(precision="fp16"),
                            schedule="async")
    try:
        run(runtimes)
    finally:
        for link in links:
            link.close()
    root, stem, leaf = runtimes
    assert root.optimization.overflows >= 1
    assert stem.optimization.overflows == leaf.optimization.overflows == 0
    assert leaf.passes.loss_scale.scale == 2.0**16 / 2**root.optimization.overflows


def test_fp16_an_epochs_short_last_update_that_overflows_is_dropped_by_every_stage():
    """An epoch of 5 batches, 2 to an update: its third update is short, and steps when the
    root says so at the epoch's end, having asked every stage whether its gradients are finite
    (check, checked). Where the root's overflowed, no stage applies it."""
    torch.manual_seed(SEED)
    model = DeepMLP()
    with torch.no_grad():
        model.inp.weight.div_(300)
    gm, prof = profile(model, (torch.zeros(BATCH, 1, 8, 8),))
    xs, ys = data(1, per_epoch=5)
    runtimes, links = build(make_plan(prof, 1), gm, xs * 300, ys, Placement(precision="fp16"))
    skipped: dict[str, list[int]] = {rt.name: [] for rt in runtimes}
    for rt in runtimes:
        def step(skip: bool = False, rt=rt, step=rt.optimization.step) -> bool:
            applied = step(skip)
            if not applied:
                skipped[rt.name].append(rt.updates + 1)
            return applied
        rt.optimization.step = step
    try:
        run(runtimes)
    finally:
        for link in links:
            link.close()
    assert [rt.updates for rt in runtimes] == [6] * 3
    root = runtimes[0].name
    assert 3 in skipped[root], skipped  # (the first epoch's short update)
    assert all(s == skipped[root] for s in skipped.values()), skipped


def test_fp16_updates_that_overflow_are_skipped_by_every_stage_and_the_scale_backs_off():
    """A loss scale far too large: the first updates' gradients overflow fp16, every stage
    skips them as GradScaler skips the whole model's step, the leaf halves its scale after
    each, and training then follows plain torch's."""
    runtimes = check_against_single_process(1, Placement(precision="fp16"), atol=2e-3,
                                            init_scale=2.0**24)
    skipped = {rt.name: rt.optimization.overflows for rt in runtimes}
    leaf = next(rt for rt in runtimes if rt.me.is_leaf)
    assert len(set(skipped.values())) == 1 and skipped[leaf.name] >= 2, skipped
    assert leaf.passes.loss_scale.scale == 2.0**24 / 2 ** skipped[leaf.name]


@pytest.mark.parametrize(("control", "said"), [
    ({"part": 0}, "does not name its batch's sizes"),
    ({"sizes": ["a", 3]}, "does not name its batch's sizes"),
    ({"sizes": 4}, "does not name its batch's sizes"),
    ({"sizes": [0, 0]}, "a batch of 0 samples")])
def test_a_forward_frame_without_its_batch_sizes_is_refused_by_name(control, said) -> None:
    """What a seed leaf scales its loss by comes from the frame: a bad one is a RavnestError
    (the worker's clear failure), not a TypeError or a division by zero."""
    assert batch_samples_of({"sizes": [3, 2]}) == 5
    with pytest.raises(RavnestError, match=said):
        batch_samples_of(control)
