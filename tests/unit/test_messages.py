"""Control messages are typed: one payload per operation (ravnest.train.messages), checked once
where a node reads them, whoever sent them; a node drops a malformed one from another cluster's
ring member and fails, naming the field, on one from its own pipeline."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from ravnest.comm.framing import Frame
from ravnest.train import messages
from ravnest.train.messages import BadControl, Kind, Op, parse
from ravnest.train.runtime import OUTSIDE

EXAMPLES = [
    messages.EvalEnd(epoch=1, step=20), messages.ValResult(
        epoch=1, step=20, val_loss=0.5, val_metric=None, smoothed=0.5, best=True,
        val_error="accuracy: MetricError: the outputs are no class scores"),
    messages.EpochEnd(epoch=2), messages.Checkpoint(step=40, epoch=2, next_batch=3),
    messages.Step(), messages.Step(skip=True), messages.Check(), messages.Checked(skip=False),
    messages.Reduce(round=4), messages.FinalReduce(),
    messages.Abort(node="node_1", error="it was lost: its process is gone"), messages.Finish(),
    messages.Rejoin(round=None, final=True, updates=66, epoch=3, next_batch=0, asked="node_0"),
    messages.Where(node="node_7", newcomer={"node": {"name": "node_7"}, "rings": ["r0"]}),
    messages.Here(updates=40, round=20, seconds_per_round=0.25),
    messages.Join(node="node_3", ring="r0", round=None, serve=True),
    messages.State(ring="r0", round=2**40, updates=66, final=True,
                   scalars={"fc.weight": {"step": 66}}, groups=[{"lr": 0.01}], scheduler=None),
    messages.Late(ring="r0", round=12, last=14), messages.Leave(round=9),
    messages.Leaving(node="node_2", ring="r1", round=9),
]


def test_every_operation_has_a_payload_that_goes_through_a_frame_unchanged() -> None:
    assert {e.op for e in EXAMPLES} == set(Op)
    for payload in EXAMPLES:
        sent = json.loads(json.dumps(payload.wire()))  # (a frame's control is JSON)
        assert sent["op"] == payload.op.value
        assert parse(sent) == payload
    # a field left at its default is not sent, as a node that sent the plain object would
    assert messages.Join(node="n", ring="r", round=3).wire() == {
        "op": Op.JOIN, "node": "n", "ring": "r", "round": 3}


@pytest.mark.parametrize(("control", "says"), [
    ({"op": "reduce"}, r"'reduce' control that is not one: round: Field required"),
    ({"op": "join", "node": "n", "ring": "r", "round": "soon"}, r"round: Input should be"),
    ({"op": "step", "extra": 1}, r"extra: Extra inputs are not permitted"),
    ({"op": "state", "ring": "r", "round": 1, "updates": 1, "scalars": [1]}, r"scalars: "),
    ({"op": "nope"}, r"no known operation: op 'nope'"),
    ({"op": ["finish"]}, r"no known operation"),
    ({}, r"no known operation: op 'None'"),
])
def test_a_malformed_control_is_refused_naming_the_field(control, says) -> None:
    with pytest.raises(BadControl, match=says):
        parse(control)


def test_a_node_drops_a_malformed_control_from_outside_and_fails_on_one_from_its_pipeline(
        caplog) -> None:
    from tests.unit.test_pipeline_inprocess import (
        BATCH,
        SEED,
        DeepMLP,
        build,
        data,
        make_plan,
        profile,
    )

    torch.manual_seed(SEED)
    gm, prof = profile(DeepMLP(), (torch.zeros(BATCH, 1, 8, 8),))
    plan = make_plan(prof, 2)
    runtimes, links = build(plan, gm, *data(2))
    node = next(rt for rt in runtimes if rt.me.cluster == 1 and rt.me.stage == 1)
    try:
        assert {Op.JOIN, Op.WHERE, Op.LEAVING} <= OUTSIDE
        with caplog.at_level(logging.WARNING):
            node.handle(Frame(Kind.CONTROL, sender="node_0", control={
                "op": "join", "node": "node_0", "ring": 7, "round": "soon"}))
        assert "round: Input should be" in caplog.text and "dropped" in caplog.text
        with pytest.raises(BadControl, match=r"from node_\d+: a 'reduce' control that is not "
                                             r"one: round: Field required"):
            node.handle(Frame(Kind.CONTROL, sender=plan.clusters[1].nodes[0],
                              control={"op": "reduce"}))
    finally:
        for link in links:
            link.close()
