"""The ring all-reduce over real gRPC, and over the TCP data plane (training.ringTransport: tcp),
one thread per rank in this process: every rank ends with the mean of all ranks' tensors
(parameters of several shapes and dtypes), whatever the transport, the ring size, the piece size
and the wire compression; and both transports give bit-identical results."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from ravnest.comm.dataplane import RingLink, RingServer
from ravnest.comm.inboxes import Inbox
from ravnest.comm.transport import Credentials, Peer, Server
from ravnest.plan.plans import RingPlan
from ravnest.train.allreducing import MAX_TAIL, RingReducer

CREDS = Credentials(token="ring-test", fingerprint="ring-plan")


TRANSPORTS = ["grpc", "tcp"]


def run_ring(world: int, make: Callable[[int], list[torch.Tensor]], *, piece_bytes: int,
             compression: str = "none", rounds: int = 1,
             transport: str = "grpc", in_place: bool = False,
             inboxes: list[Inbox] | None = None,
             movable: bool | int = False, quantized: int = 0) -> list[list[torch.Tensor]]:
    """`movable`: True for all of each rank's tensors, or how many of the first ones;
    `quantized`: how many of those go as int8 codes (compression int8)."""
    inboxes = inboxes or [Inbox() for _ in range(world)]
    members = tuple(f"r{i}" for i in range(world))
    servers: list[Server | RingServer]
    peers: list[Peer | RingLink]
    if transport == "grpc":
        servers = [Server("127.0.0.1:0", CREDS, inbox.deliver) for inbox in inboxes]
        peers = [Peer(f"127.0.0.1:{servers[(i + 1) % world].port}", CREDS,
                      compression=compression) for i in range(world)]
    else:
        servers = [RingServer("127.0.0.1:0", CREDS.token, CREDS.fingerprint, inbox.deliver,
                              inbox=inbox) for inbox in inboxes]
        peers = [RingLink(f"127.0.0.1:{servers[(i + 1) % world].port}", CREDS.token,
                          CREDS.fingerprint, members[i], compression=compression, timeout=60)
                 for i in range(world)]
    for server in servers:
        server.start()
    ring = RingPlan(id="ring-0", members=members, state=())
    tensors = [make(i) for i in range(world)]
    outcomes: list[list[bool]] = [[] for _ in range(world)]

    def rank(i: int) -> None:
        reducer = RingReducer(ring, members[i], {members[(i + 1) % world]: peers[i]},
                              inboxes[i], timeout=60, compression=compression,
                              piece_bytes=piece_bytes)
        for round_ in range(1, rounds + 1):
            if in_place:
                (flat,) = tensors[i]
                reducer.all_reduce_(flat, round_)
                outcomes[i].append(True)
            else:
                count = len(tensors[i]) if movable is True else int(movable)
                outcomes[i].append(reducer.average(tensors[i], round_, count, quantized))

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(world)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a rank is still waiting on the ring"
    finally:
        for peer in peers:
            peer.close()
        for server in servers:
            server.stop()
    assert outcomes == [[True] * rounds] * world
    return tensors


def state(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(37, 5, generator=g), torch.randn(101, generator=g),
            torch.randn(3, 3, 3, generator=g).double(), torch.tensor([rank * 10 + 3]),
            torch.empty(0), torch.randn(6, 4, generator=g).t(),  # an empty and a strided one
            torch.randn(1, generator=g)]


@pytest.mark.parametrize("movable", [False, True], ids=["copied", "moved"])
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("piece_bytes", [4, 64, 1 << 22])
def test_every_rank_ends_with_the_mean(world: int, piece_bytes: int, transport: str,
                                       movable: bool) -> None:
    expected = [torch.stack([state(r)[j].double() for r in range(world)]).mean(0)
                for j in range(len(state(0)))]
    result = run_ring(world, state, piece_bytes=piece_bytes, transport=transport,
                      movable=movable, rounds=2)
    for rank_tensors in result:
        for j, (got, want) in enumerate(zip(rank_tensors, expected, strict=True)):
            assert got.dtype == state(0)[j].dtype
            if got.dtype.is_floating_point:
                torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)
            else:  # integer buffers (e.g. BatchNorm's num_batches_tracked) get the rounded mean
                assert torch.equal(got, want.round().to(got.dtype))
    # every rank holds bit-identical results
    for other in result[1:]:
        assert all(torch.equal(a, b) for a, b in zip(result[0], other, strict=True))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_fewer_elements_than_ranks_and_repeated_rounds(transport: str) -> None:
    result = run_ring(4, lambda r: [torch.full((2,), float(r))], piece_bytes=4, rounds=3,
                      transport=transport)
    assert all(torch.equal(t[0], torch.full((2,), 1.5)) for t in result)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("compression", ["bf16", "fp16"])
def test_compressed_wire_stays_close_and_identical_on_every_rank(compression: str,
                                                                 transport: str) -> None:
    world = 3
    make = lambda r: [torch.randn(10_000, generator=torch.Generator().manual_seed(r))]  # noqa: E731
    expected = torch.stack([make(r)[0] for r in range(world)]).mean(0)
    result = run_ring(world, make, piece_bytes=4096, compression=compression, transport=transport)
    for (got,) in result:
        assert (got - expected).abs().max().item() < 2e-2
    assert all(torch.equal(result[0][0], t[0]) for t in result[1:])


@pytest.mark.parametrize("movable", [False, True], ids=["copied", "moved"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_int8_pieces_stay_close_the_rest_exact_and_every_rank_identical(transport: str,
                                                                       movable: bool) -> None:
    """compression int8: the quantized tensors' mean within half a block scale (largest value /
    127) per hop of rounding, the other tensors' mean as exact as without compression (float32
    on links that round floats to bfloat16, gRPC's), every rank bit-identical; pieces of 1,000
    elements, so blocks and pieces and the quantized part's end do not line up."""
    world = 3

    def make(r: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(r)
        return [torch.randn(3_001, generator=g), torch.randn(40, 7, generator=g) * 1e-3,
                torch.randn(555, generator=g) + 100.0, torch.tensor([r * 10 + 3])]

    expected = [torch.stack([make(r)[j].double() for r in range(world)]).mean(0)
                for j in range(4)]
    result = run_ring(world, make, piece_bytes=4_000, compression="int8", transport=transport,
                      movable=3 if movable else 0, quantized=2 if movable else 0)
    for got in result:
        if movable:
            # a block's scale is its largest sum of 3 values over 127; blocks run on across the
            # tensors: 3 segments of 1,279, pieces of 1,000 and blocks of 256 put the small
            # tensor's first 69 values in a block with the large one's last, at its scale
            err = [(got[j].double() - expected[j]).abs().flatten() for j in range(2)]
            assert 0 < err[0].max().item() < 3 * 5 / 127
            assert err[1][:69].max().item() < 3 * 5 / 127
            assert 0 < err[1][69:].max().item() < 3 * 5e-3 / 127
        for j in range(0 if not movable else 2, 3):
            torch.testing.assert_close(got[j].double(), expected[j], rtol=1e-6, atol=1e-6)
        assert torch.equal(got[3], expected[3].round().long())
    for other in result[1:]:
        assert all(torch.equal(a, b) for a, b in zip(result[0], other, strict=True))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_fp16_wire_sends_a_piece_it_cannot_hold_uncompressed(transport: str) -> None:
    """A piece beyond float16's range (65504) goes as float32 instead of as inf, so its mean is
    exact; pieces in range are rounded to float16 on the way; every rank ends the same."""
    world = 3
    big = lambda r: [torch.cat([torch.full((500,), 1e5 + r),  # noqa: E731
                                torch.full((500,), 0.1 + r)])]
    result = run_ring(world, big, piece_bytes=1000, compression="fp16", transport=transport)
    for (got,) in result:
        assert torch.equal(got[:500], torch.full((500,), 1e5 + 1))
        assert (got[500:] - 1.1).abs().max().item() < 2e-3
    assert all(torch.equal(result[0][0], t[0]) for t in result[1:])


@pytest.mark.parametrize("compression", ["none", "bf16"])
def test_both_transports_give_identical_results(compression: str) -> None:
    """The data plane carries the same bytes as gRPC: the same inputs end bit-identical."""
    make = lambda r: [torch.randn(5_000, generator=torch.Generator().manual_seed(r)),  # noqa: E731
                      torch.randn(7, 3, generator=torch.Generator().manual_seed(r + 9))]
    grpc_result = run_ring(3, make, piece_bytes=1024, compression=compression)
    tcp_result = run_ring(3, make, piece_bytes=1024, compression=compression, transport="tcp")
    for a, b in zip(grpc_result, tcp_result, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_all_reduce_in_place_gives_the_same_mean(transport: str) -> None:
    """all_reduce_ (the ring alone, on a caller's flat float32 buffer) ends where average does."""
    world = 3
    make = lambda r: [torch.randn(3_001, generator=torch.Generator().manual_seed(r))]  # noqa: E731
    expected = run_ring(world, make, piece_bytes=512, transport=transport)
    flats = [make(r)[0] for r in range(world)]
    run_ring(world, lambda r: [flats[r]], piece_bytes=512, transport=transport, in_place=True)
    for (want,), got in zip(expected, flats, strict=True):
        assert torch.equal(got, want)
    reducer = RingReducer(RingPlan(id="x", members=("a", "b"), state=()), "a", {"b": None},
                          Inbox(), timeout=1)  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="float32"):
        reducer.all_reduce_(torch.zeros(4, dtype=torch.float64), 1)


class CountingInbox(Inbox):
    def __init__(self) -> None:
        super().__init__()
        self.landed_pieces = 0

    def landed(self, ring: str, round_: int, phase: int) -> None:
        self.landed_pieces += 1
        super().landed(ring, round_, phase)


@pytest.mark.parametrize(("compression", "landed"), [("none", 2 * 2 * 4), ("bf16", 0)])
def test_on_the_data_plane_gathered_pieces_land_in_place(compression: str, landed: int) -> None:
    """With fp32 on the wire every all-gather piece is received straight into the ring's own
    tensor: 3 ranks, segments of 1,000 elements in 4 pieces, 2 gather steps, 2 rounds. bf16 pieces
    cannot (another dtype) and go through a buffer. The mean is the same either way."""
    world = 3
    make = lambda r: [torch.randn(3_000, generator=torch.Generator().manual_seed(r))]  # noqa: E731
    expected = torch.stack([make(r)[0] for r in range(world)]).mean(0)
    inboxes = [CountingInbox() for _ in range(world)]
    result = run_ring(world, make, piece_bytes=1024, compression=compression, transport="tcp",
                      rounds=2, inboxes=list(inboxes))
    assert [inbox.landed_pieces for inbox in inboxes] == [landed] * world
    for (got,) in result:
        assert (got - expected).abs().max().item() < (1e-6 if landed else 2e-2)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_moved_tensors_stay_the_same_objects_and_follow_their_optimizer(transport: str) -> None:
    """What training passes as movable (a stage's parameters and buffers): after rounds they are
    the same objects, now views of one buffer, holding the mean; an optimizer built before the
    first round still updates them; one replaced between rounds (as a checkpoint load may) is
    moved again; and every round ends where the copying path's mean is."""
    world = 3

    def make(rank: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(rank)
        return [torch.nn.Parameter(torch.randn(40, 7, generator=g)),
                torch.nn.Parameter(torch.randn(7, generator=g)),
                torch.tensor([rank], dtype=torch.int64),  # a buffer the ring copies
                torch.randn(5, generator=g)]

    models = [make(r) for r in range(world)]
    objects = [[id(t) for t in m] for m in models]
    optimizers = [torch.optim.SGD(m[:2], lr=0.5) for m in models]
    run_ring(world, lambda r: models[r], piece_bytes=256, transport=transport, movable=True)
    for r, m in enumerate(models):
        assert [id(t) for t in m] == objects[r]
        assert isinstance(m[0], torch.nn.Parameter) and m[0].requires_grad
        float_storages = {t.untyped_storage().data_ptr() for t in (m[0], m[1], m[3])}
        assert len(float_storages) == 1, "the float32 tensors were not moved into one buffer"
        assert torch.equal(m[0], models[0][0]) and torch.equal(m[2], torch.tensor([1]))
    mean0 = torch.stack([make(r)[0] for r in range(world)]).mean(0)
    torch.testing.assert_close(models[0][0].detach(), mean0, rtol=0, atol=1e-6)
    for r, (m, opt) in enumerate(zip(models, optimizers, strict=True)):
        (m[0].sum() * (r + 1)).backward()  # gradient r + 1 everywhere: mean step 0.5 * 2
        opt.step()
    models[1][3].data = models[1][3].data.clone()  # replaced since the last round
    run_ring(world, lambda r: models[r], piece_bytes=256, transport=transport, movable=True)
    torch.testing.assert_close(models[2][0].detach(), mean0 - 1.0, rtol=0, atol=1e-5)
    assert len({models[1][i].untyped_storage().data_ptr() for i in (0, 1, 3)}) == 1
    for m in models[1:]:
        assert all(torch.equal(a, b) for a, b in zip(models[0], m, strict=True))


def test_tied_tensors_are_copied_not_moved() -> None:
    """Two names of one weight (tied embeddings) stay one weight: moving it would untie them."""
    world = 2
    tied = [torch.randn(10, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    models = [[tied[r], tied[r][:5]] for r in range(world)]  # the second is a view of the first
    expected = (tied[0] + tied[1]) / 2
    run_ring(world, lambda r: models[r], piece_bytes=64, transport="tcp", movable=True)
    for r in range(world):
        assert models[r][1].data_ptr() == models[r][0].data_ptr()
        torch.testing.assert_close(models[r][0], expected, rtol=0, atol=1e-6)


def test_moved_tensors_are_saved_without_what_is_copied_beside_them(tmp_path) -> None:
    """A stage file (torch.save of moved parameters) holds the parameters and at most a small
    tail, never a large copied part such as averaged optimizer state: then nothing is moved."""
    world = 2
    small = [[torch.nn.Parameter(torch.randn(100_000)), torch.tensor([r])] for r in range(world)]
    run_ring(world, lambda r: small[r], piece_bytes=1 << 16, transport="tcp", movable=True)
    torch.save({"w": small[0][0]}, tmp_path / "small.pt")
    assert (tmp_path / "small.pt").stat().st_size < 400_000 + 8 + 4096
    big = [[torch.nn.Parameter(torch.randn(100_000)), torch.randn(MAX_TAIL + 1)]
           for _ in range(world)]  # a parameter, then (not movable) its optimizer's state
    before = [b[0].data_ptr() for b in big]
    expected = (big[0][0] + big[1][0]) / 2
    run_ring(world, lambda r: big[r], piece_bytes=1 << 16, transport="tcp", movable=1)
    assert [b[0].data_ptr() for b in big] == before  # copied in place, not moved
    torch.testing.assert_close(big[1][0].detach(), expected, rtol=0, atol=1e-6)
