"""The ring all-reduce over real gRPC, one thread per rank in this process: every rank ends with the
mean of all ranks' tensors (parameters of several shapes and dtypes), whatever the ring size, the
piece size and the wire compression."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from ravnest.allreducing import RingReducer
from ravnest.planning import RingPlan
from ravnest.transport import Credentials, Inbox, Peer, Server

CREDS = Credentials(token="ring-test", fingerprint="ring-plan")


def run_ring(world: int, make: Callable[[int], list[torch.Tensor]], *, piece_bytes: int,
             compression: str = "none", rounds: int = 1) -> list[list[torch.Tensor]]:
    inboxes = [Inbox() for _ in range(world)]
    servers = [Server("127.0.0.1:0", CREDS, inbox.deliver) for inbox in inboxes]
    for server in servers:
        server.start()
    members = tuple(f"r{i}" for i in range(world))
    ring = RingPlan(id="ring-0", members=members, state=())
    peers = [Peer(f"127.0.0.1:{servers[(i + 1) % world].port}", CREDS, compression=compression)
             for i in range(world)]
    tensors = [make(i) for i in range(world)]
    outcomes: list[list[bool]] = [[] for _ in range(world)]

    def rank(i: int) -> None:
        reducer = RingReducer(ring, members[i], {members[(i + 1) % world]: peers[i]},
                              inboxes[i], timeout=60, compression=compression,
                              piece_bytes=piece_bytes)
        for round_ in range(1, rounds + 1):
            outcomes[i].append(reducer.average(tensors[i], round_))

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
            server.stop(0)
    assert outcomes == [[True] * rounds] * world
    return tensors


def state(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(37, 5, generator=g), torch.randn(101, generator=g),
            torch.randn(3, 3, 3, generator=g).double(), torch.tensor([rank * 10 + 3]),
            torch.randn(1, generator=g)]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("piece_bytes", [4, 64, 1 << 22])
def test_every_rank_ends_with_the_mean(world: int, piece_bytes: int) -> None:
    expected = [torch.stack([state(r)[j].double() for r in range(world)]).mean(0)
                for j in range(len(state(0)))]
    result = run_ring(world, state, piece_bytes=piece_bytes)
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


def test_fewer_elements_than_ranks_and_repeated_rounds() -> None:
    result = run_ring(4, lambda r: [torch.full((2,), float(r))], piece_bytes=4, rounds=3)
    assert all(torch.equal(t[0], torch.full((2,), 1.5)) for t in result)


@pytest.mark.parametrize("compression", ["bf16", "fp16"])
def test_compressed_wire_stays_close_and_identical_on_every_rank(compression: str) -> None:
    world = 3
    make = lambda r: [torch.randn(10_000, generator=torch.Generator().manual_seed(r))]  # noqa: E731
    expected = torch.stack([make(r)[0] for r in range(world)]).mean(0)
    result = run_ring(world, make, piece_bytes=4096, compression=compression)
    for (got,) in result:
        assert (got - expected).abs().max().item() < 2e-2
    assert all(torch.equal(result[0][0], t[0]) for t in result[1:])
