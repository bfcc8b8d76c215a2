"""int8 rings (`training.compression: int8`, comm/quantizing.py, train/allreducing.py): the codes'
rounding, error feedback over rounds (a ring of threads over loopback links), a piece that does
not fit, and DiLoCo in int8 against DiLoCo in float32 in one process."""

from __future__ import annotations

import threading

import pytest
import torch
from test_outer import NESTEROV, diloco, two_clusters

from ravnest.comm.framing import Frame
from ravnest.comm.inboxes import Inbox
from ravnest.comm.loopback import Loopback
from ravnest.comm.quantizing import BLOCK, blocks, dequantize, quantize
from ravnest.plan.plans import RingPlan
from ravnest.train.allreducing import TAG_SHIFT, RingReducer


@pytest.mark.parametrize("n", [1, BLOCK - 1, BLOCK, BLOCK + 1, 1000])
def test_each_value_is_rounded_to_within_half_its_blocks_scale(n: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    x[:min(n, BLOCK)] *= 100  # blocks of very different scales
    codes, scales = torch.empty(n, dtype=torch.int8), torch.empty(blocks(n))
    quantize(x, codes, scales)
    got = dequantize(codes, scales, torch.empty(n))
    per_value = scales.repeat_interleave(BLOCK)[:n]
    assert (x - got).abs().le(per_value / 2 * (1 + 1e-5)).all()
    assert codes.abs().max().item() == 127  # each block's largest value is its full scale
    for b in range(blocks(n)):
        block = x[b * BLOCK:(b + 1) * BLOCK]
        assert scales[b].item() == pytest.approx(block.abs().max().item() / 127, rel=1e-6)


def test_zeros_stay_exact_and_a_block_with_a_value_not_finite_decodes_to_nan() -> None:
    x = torch.zeros(3 * BLOCK)
    x[BLOCK + 5] = float("nan")
    x[2 * BLOCK + 7] = float("inf")
    codes, scales = torch.empty(3 * BLOCK, dtype=torch.int8), torch.empty(3)
    quantize(x, codes, scales)
    got = dequantize(codes, scales, torch.empty(3 * BLOCK))
    assert torch.equal(got[:BLOCK], torch.zeros(BLOCK))
    assert got[BLOCK:].isnan().all()  # a diverged run shows as one, not as zeros


def ring(world: int, rounds: dict[int, list[int]], make, *, timeout: float = 30.0,
         piece_bytes: int = 4_000) -> dict[int, list[tuple[bool, torch.Tensor]]]:
    """Threads of one ring over loopback links, rank r taking part in `rounds[r]`: each round
    averages a fresh `make(r)` (all of it quantized, as pseudo-gradients are); each rank's
    (outcome, tensor after the round) per round."""
    members = tuple(f"r{i}" for i in range(world))
    inboxes = [Inbox() for _ in members]
    links = [Loopback(inboxes[(i + 1) % world].deliver, f"r{i}") for i in range(world)]
    plan = RingPlan(id="ring-0", members=members, state=())
    out: dict[int, list[tuple[bool, torch.Tensor]]] = {i: [] for i in range(world)}

    def rank(i: int) -> None:
        reducer = RingReducer(plan, members[i], {members[(i + 1) % world]: links[i]},
                              inboxes[i], timeout=timeout, compression="int8",
                              piece_bytes=piece_bytes)
        for round_ in rounds[i]:
            t = make(i)
            out[i].append((reducer.average([t], round_, 1, 1), t))

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(world)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
    finally:
        for link in links:
            link.close()
    return out


def pseudo_gradient(rank: int) -> torch.Tensor:
    return torch.randn(3_000, generator=torch.Generator().manual_seed(rank)) * (1 + rank)


def test_error_feedback_keeps_the_sum_over_rounds_within_one_rounds_rounding() -> None:
    """The same pseudo-gradients round after round: rounding to the nearest gives one round's
    mean the same error each time; fed back, the errors do not add up: after 30 rounds the sum
    of the means is off by less than twice one round's error (30 times it without feedback)."""
    world, rounds = 3, 30
    mean = torch.stack([pseudo_gradient(r) for r in range(world)]).mean(0)
    out = ring(world, {i: list(range(1, rounds + 1)) for i in range(world)}, pseudo_gradient)
    for i in range(world):
        assert [done for done, _ in out[i]] == [True] * rounds
        # every member holds the same values, round after round
        assert all(torch.equal(t, other) for (_, t), (_, other) in zip(out[0], out[i],
                                                                       strict=True))
    first = (out[0][0][1] - mean).abs().max().item()
    assert 0 < first < 0.2
    sums = torch.stack([t for _, t in out[0]]).cumsum(0)  # the means summed over k rounds
    worst = max((sums[k - 1] - k * mean).abs().max().item() for k in range(1, rounds + 1))
    assert worst < 2 * first


def test_a_skipped_round_keeps_what_the_last_one_lost_for_the_next() -> None:
    """r0 waits alone in round 2 (skipped), and rounds 1 and 3 still sum to twice the mean
    within one round's rounding: what round 1 lost goes into round 3."""
    mean = torch.stack([pseudo_gradient(r) for r in range(2)]).mean(0)
    out = ring(2, {0: [1, 2, 3], 1: [1, 3]}, pseudo_gradient, timeout=0.5)
    assert [done for done, _ in out[0]] == [True, False, True]
    (_, one), (_, three) = out[0][0], out[0][2]
    assert torch.equal(one, out[1][0][1]) and torch.equal(three, out[1][1][1])
    first = (one - mean).abs().max().item()
    assert (one + three - 2 * mean).abs().max().item() < 1.5 * first


def test_a_piece_that_does_not_fit_skips_the_round_and_changes_nothing() -> None:
    """A peer's int8 piece of the wrong size (or dtype): the round is skipped and the tensor
    keeps its value."""
    plan = RingPlan(id="ring-0", members=("a", "b"), state=())
    inbox = Inbox()
    sink = Inbox()
    link = Loopback(sink.deliver, "a")
    reducer = RingReducer(plan, "a", {"b": link}, inbox, timeout=5.0, compression="int8")
    t = torch.randn(1_000)
    before = t.clone()
    for x in (torch.zeros(17, dtype=torch.uint8), torch.zeros(500)):
        phase = 0 << TAG_SHIFT  # reduce step 0 of the ring's only piece of its segment
        inbox.deliver(Frame(kind="reduce", tensors={"x": x}, step=1, version=phase,
                            ring="ring-0", sender="b"))
        assert reducer.average([t], 1, 1, 1) is False
        assert torch.equal(t, before)
    link.close()


def test_diloco_in_int8_ends_near_diloco_in_float32_and_alike_in_both_clusters() -> None:
    """Two clusters' pipelines, Nesterov outer steps every 2 updates, pseudo-gradients in int8:
    both clusters end with the same weights, near single-process DiLoCo's in float32."""
    runtimes, (initial, _, _, xs, ys) = two_clusters(reduce_factor=2, outer=NESTEROV,
                                                     compression="int8")
    assert sum(rt.rounds_skipped for rt in runtimes) == 0
    expected = diloco(initial, xs, ys, 2, NESTEROV)
    clusters = [{k: v for rt in runtimes if rt.me.cluster == c
                 for k, v in rt.stage.stage_state_dict().items()} for c in range(2)]
    assert all(torch.equal(clusters[0][k], clusters[1][k]) for k in expected)
    moved = max((expected[k] - initial.state_dict()[k]).abs().max().item() for k in expected)
    off = max((clusters[0][k] - expected[k]).abs().max().item() for k in expected)
    assert 0 < off < moved / 100, (off, moved)
