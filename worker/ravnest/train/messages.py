"""Messages: the vocabulary of the frames a cluster's nodes exchange along the pipeline.

Frame kinds and control operations are string enums, so that they compare equal to the plain
strings a decoded frame carries (`Kind(frame.kind)`, `Op(control["op"])` refuse any other) and
encode as those strings.

Each operation's control is a typed payload (`EvalEnd`, `Reduce`, `Join`, ...: one per `Op`). A
node sends `payload.wire()`, a JSON object as before, and reads a control it receives with
`parse`, which checks it once, whoever sent it: a control that is no payload of its `Op` (a field
missing, of another type, or unknown) raises `BadControl` naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from ravnest.errors import RavnestError

LABELS = "__labels__"
"""Name of the labels tensor in forward and eval frames, carried down to the leaf."""


class Kind(StrEnum):
    """What a pipeline frame carries."""

    FORWARD = "forward"
    """Downstream: a training microbatch's activations (and the labels)."""
    BACKWARD = "backward"
    """Upstream: the gradients of a stage's inputs, and the leaf's loss in `control`."""
    EVAL = "eval"
    """Downstream: a validation batch's activations (and the labels)."""
    CONTROL = "control"
    """Either way: an operation (`Op`) in `control`, at a point where the pipeline is drained."""


class Op(StrEnum):
    """The operation of a control frame (its `control["op"]`)."""

    EVAL_END = "eval_end"
    """Down: the validation batches were all sent; keep a snapshot of the weights."""
    VAL_RESULT = "val_result"
    """Up from the leaf: the validation's loss and metric, and whether its weights are best."""
    EPOCH_END = "epoch_end"
    """Down: `epoch` is over (schedulers that step per epoch step)."""
    CHECKPOINT = "checkpoint"
    """Down: save the node's state as `step`, resuming at `epoch`, `next_batch`."""
    STEP = "step"
    """Down, at the end of an epoch: step an update whose batches ran out before it was full;
    in fp16 (sync), after every update too: apply it, or drop it (`skip`: a stage overflowed)."""
    CHECK = "check"
    """Down, in fp16 (sync), before an epoch's short last update steps: are its gradients
    finite?"""
    CHECKED = "checked"
    """Up, the answer: `skip` when this stage's gradients or a later one's were not finite."""
    REDUCE = "reduce"
    """Down: a ring round (`round`) at the end of an epoch (the seed API's reduce_factor=None)."""
    FINAL_REDUCE = "final_reduce"
    """Down: the ring round every node joins after training."""
    ABORT = "abort"
    """Either way: `node` failed with `error` (sent by a failing node, or put in a node's inbox
    when its watch lost a neighbour); the cluster stops, naming it."""
    FINISH = "finish"
    """Down: training is over."""
    REJOIN = "rejoin"
    """Down a restarted cluster, before it trains: its join `round`, and where it resumes
    (`updates`, `epoch`, `next_batch`; `final`: it takes the final state), see `rejoining`."""
    WHERE = "where"
    """From a restarted cluster's root to a ring member: where is training?"""
    HERE = "here"
    """The answer: the member's `updates`, its last `round` and its `seconds_per_round`."""
    JOIN = "join"
    """From a restarted node to the other members of its `ring`: take it in after `round`, and
    (`serve`) send it the ring's state then."""
    STATE = "state"
    """To a restarted node: a `ring`'s tensors and optimizer state after `round`, with the
    sender's `updates` (tensors named as `rejoining.pack_state` names them)."""
    LATE = "late"
    """To a restarted node: the sender is past the join `round` already (its last is `last`)."""
    LEAVE = "leave"
    """Down a cluster told to drain: it leaves the rings after `round` and stops then."""
    LEAVING = "leaving"
    """From a draining node to the other members of its `ring`: go without it after `round`."""


class BadControl(RavnestError):
    """A control frame that is no payload of its operation."""


class Payload(BaseModel):
    """A control's payload: its operation (`op`) and that operation's fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    op: Op

    def wire(self) -> dict[str, Any]:
        """The control as a frame carries it: `op` and the fields given (those left at their
        default are left out, as a node that sent the plain object would)."""
        return {"op": self.op, **self.model_dump(exclude_unset=True, exclude={"op"})}


class EvalEnd(Payload):
    op: Literal[Op.EVAL_END] = Op.EVAL_END
    epoch: int
    step: int


class ValResult(Payload):
    op: Literal[Op.VAL_RESULT] = Op.VAL_RESULT
    epoch: int
    step: int
    val_loss: float
    val_metric: float | None = None
    smoothed: float | None = None
    best: bool = False
    val_error: str | None = None
    """What the validation could not compute (a metric the model's outputs do not allow)."""


class EpochEnd(Payload):
    op: Literal[Op.EPOCH_END] = Op.EPOCH_END
    epoch: int
    val_loss: float | None = None
    """The root's validation loss of the epoch (None: no validation then; NaN: none computed),
    which a ReduceLROnPlateau scheduler steps on at every stage when it is finite."""


class Checkpoint(Payload):
    op: Literal[Op.CHECKPOINT] = Op.CHECKPOINT
    step: int
    epoch: int
    next_batch: int


class Step(Payload):
    op: Literal[Op.STEP] = Op.STEP
    skip: bool | None = None
    """None: each stage steps what it has (its own fp16 check). Else the whole update's
    outcome, which every stage takes (fp16, sync: `runtime`'s held steps)."""


class Check(Payload):
    op: Literal[Op.CHECK] = Op.CHECK


class Checked(Payload):
    op: Literal[Op.CHECKED] = Op.CHECKED
    skip: bool


class Reduce(Payload):
    op: Literal[Op.REDUCE] = Op.REDUCE
    round: int


class FinalReduce(Payload):
    op: Literal[Op.FINAL_REDUCE] = Op.FINAL_REDUCE


class Abort(Payload):
    op: Literal[Op.ABORT] = Op.ABORT
    node: str
    error: str


class Finish(Payload):
    op: Literal[Op.FINISH] = Op.FINISH


class Rejoin(Payload):
    op: Literal[Op.REJOIN] = Op.REJOIN
    round: int | None
    """The round the cluster joins after (None: it takes the final state)."""
    final: bool
    updates: int
    epoch: int
    next_batch: int
    asked: str | None = None
    """The ring member the root asked where training is."""


class Where(Payload):
    op: Literal[Op.WHERE] = Op.WHERE
    node: str
    newcomer: dict[str, Any] | None = None
    """A node of a cluster added to the running job introduces itself (`rejoining.NEWCOMER`)."""


class Here(Payload):
    op: Literal[Op.HERE] = Op.HERE
    updates: int
    round: int
    seconds_per_round: float = 0.0


class Join(Payload):
    op: Literal[Op.JOIN] = Op.JOIN
    node: str
    ring: str
    round: int | None
    serve: bool = False
    newcomer: dict[str, Any] | None = None


class State(Payload):
    op: Literal[Op.STATE] = Op.STATE
    ring: str
    round: int
    updates: int
    final: bool = False
    scalars: dict[str, dict[str, Any]] = {}
    """The optimizer's non-tensor state of each parameter (its tensors are the frame's)."""
    groups: list[dict[str, Any]] | None = None
    """The optimizer's hyperparameters, by parameter group."""
    scheduler: dict[str, Any] | None = None


class Late(Payload):
    op: Literal[Op.LATE] = Op.LATE
    ring: str
    round: int | None
    last: int


class Leave(Payload):
    op: Literal[Op.LEAVE] = Op.LEAVE
    round: int


class Leaving(Payload):
    op: Literal[Op.LEAVING] = Op.LEAVING
    node: str
    ring: str
    round: int


Control = Annotated[EvalEnd | ValResult | EpochEnd | Checkpoint | Step | Check | Checked
                    | Reduce | FinalReduce
                    | Abort | Finish | Rejoin | Where | Here | Join | State | Late | Leave
                    | Leaving, Field(discriminator="op")]
"""Any operation's payload."""

_CONTROL: TypeAdapter[Control] = TypeAdapter(Control)
OPS = frozenset(o.value for o in Op)


def parse(control: Mapping[str, Any]) -> Control:
    """The payload a control frame carries (`control`: its decoded JSON object). BadControl,
    naming the fields, when it is none."""
    op = control.get("op")
    if not isinstance(op, str) or op not in OPS:
        raise BadControl(f"a control of no known operation: op {str(op)[:40]!r}")
    try:
        return _CONTROL.validate_python(dict(control))
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc'][1:])}: {err['msg']}"
                             for err in e.errors())
        raise BadControl(f"a {op!r} control that is not one: {problems}") from None
