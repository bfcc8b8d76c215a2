"""Messages: the vocabulary of the frames a cluster's nodes exchange along the pipeline.

Frame kinds and control operations are string enums, so that they compare equal to the plain
strings a decoded frame carries (`Kind(frame.kind)`, `Op(control["op"])` refuse any other) and
encode as those strings.
"""

from __future__ import annotations

from enum import StrEnum

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
    """Down, at the end of an epoch: step an update whose batches ran out before it was full."""
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
