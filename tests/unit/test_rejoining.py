"""Rejoining (elastic training): who a round goes without, the join round and where a restarted
cluster's data resumes, and the state a ring member sends a restarted node, which must continue
training exactly as the sender does (compared with the sender itself, stepped on the same
gradients)."""

from __future__ import annotations

import torch
from handover import continue_as_sender, node

from ravnest.train.rejoining import (
    RingMembership,
    RoundClock,
    join_round,
    resume_position,
)


def test_a_lost_member_stays_out_until_it_rejoins_or_is_back_from_a_cut():
    m = RingMembership()
    assert m.absent(5) == set()
    m.lost("b")
    m.lost("c")
    assert m.absent(5) == {"b", "c"} and m.absent(10**12) == {"b", "c"}
    m.admit("b", 8)  # restarted: in again from round 8
    assert m.absent(7) == {"b", "c"} and m.absent(8) == {"c"}
    m.back("c")  # a cut healed: in again at once
    assert m.absent(9) == set()
    m.lost("b")  # lost again after it rejoined
    assert m.absent(9) == {"b"}
    m.leave("c", 12)  # drains: out for good from round 12
    assert m.absent(11) == {"b"} and m.absent(12) == {"b", "c"} and m.leaving() == {"c"}
    m.back("c")  # its exit, seen by a watch, does not bring it back
    assert m.absent(10**12) == {"b", "c"}
    # why the watch took a member for lost is kept, for the error of a node that needed it
    m.lost("b", "no answer from b:50051 for 3.1s since its connection broke")
    assert m.why({"b", "c"}) == "b: no answer from b:50051 for 3.1s since its connection broke"


def test_the_loss_of_the_old_process_seen_after_the_new_one_joined_does_not_undo_the_join():
    """A restarted member's `join` can come before this node's watch sees its old process go
    (seen in a local run: the round after the join round was then formed without it here and
    with it elsewhere, and skipped after its 30 s timeout)."""
    m = RingMembership()
    m.admit("b", 8)  # the new process joins while the old one is still counted in
    m.lost("b", "its connection broke")  # the old process's loss, seen late
    assert m.absent(7) == {"b"} and m.absent(8) == set() and not m.awaiting("b")
    m.lost("b")  # past its join round: a loss is the joined process's
    assert m.absent(9) == {"b"} and m.awaiting("b")
    # a join that comes once the loss was seen is the usual order: a later loss is a loss
    m.admit("b", 12)
    m.lost("b")
    assert m.absent(12) == {"b"} and m.awaiting("b")
    # the absorbed loss is one only: the joined process lost before its round is out again
    m.back("c")
    m.admit("c", 20)
    m.lost("c")
    m.lost("c")
    assert m.absent(20) == {"b", "c"}


def test_the_join_round_is_the_margin_ahead_and_the_final_one_past_the_end():
    assert join_round(10, 0.5, last=100, margin=5.0) == 20
    assert join_round(10, 60.0, last=100, margin=5.0) == 12  # at least two rounds ahead
    assert join_round(10, 0.0, last=None, margin=1.0) == 1010  # unknown pace: 1 ms a round
    # an answer that took 7 s to come is 7 s old: the round is that much further ahead
    assert join_round(10, 0.5, last=100, margin=5.0, waited=7.0) == 34
    assert join_round(10, 0.5, last=30, margin=5.0, waited=7.0) is None  # past the end: final
    assert join_round(95, 0.5, last=100, margin=5.0) is None  # past the last round: final


def test_a_round_stalled_by_a_loss_does_not_bring_the_join_round_nearer():
    clock = RoundClock()
    assert clock.seconds is None
    for r in range(1, 11):  # rounds of 1/8 s
        clock.done(r, r / 8)
    clock.done(11, 10 / 8 + 30.0)  # the round that waited for a lost member
    clock.done(12, 11 / 8 + 30.0)
    assert clock.seconds == 1 / 8
    # the join round stays 5 s of its real rounds ahead, not 5 s of the stalled one
    assert join_round(clock.last, clock.seconds, last=None, margin=5.0) == 12 + 40


def test_a_resumed_root_starts_where_the_drive_loop_would_have_counted_those_updates():
    per_epoch, uf = 14, 2  # 7 updates an epoch
    assert resume_position(0, per_epoch, uf) == (0, 0)
    assert resume_position(3, per_epoch, uf) == (0, 6)
    assert resume_position(10, per_epoch, uf) == (1, 6)
    # at an epoch's end: that epoch's end (its validation and epoch step still to come)
    assert resume_position(7, per_epoch, uf) == (0, 14)
    assert resume_position(14, per_epoch, uf) == (1, 14)
    # the batch after the resume position completes update (updates + 1), as in `drive`
    for updates in range(1, 30):
        epoch, batch = resume_position(updates, per_epoch, uf)
        if batch == per_epoch:
            epoch, batch = epoch + 1, 0
        assert epoch * 7 + (batch + uf) // uf == updates + 1


def test_the_state_sent_lets_a_restarted_node_continue_exactly_as_its_sender():
    continue_as_sender(node(2))


def test_the_state_lands_where_the_joiners_optimizer_keeps_it():
    """A joiner whose parameters are of another dtype (and, on a GPU, another device: tests/gpu)
    gets the optimizer state beside them, as Optimizer.load_state_dict would place it; its
    step count stays as it came."""
    # (fc1.bias comes before a batch norm: its gradient is ~0, and Adam turns float32's and
    # float64's rounding of it into steps of the learning rate's size, 0.01)
    _, join_opt = continue_as_sender(node(2, torch.float64), atol=0.02)
    for p, st in join_opt.optimizer.state.items():
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == p.dtype == torch.float64
        assert st["step"].dtype == torch.float32 and st["step"].device.type == "cpu"
