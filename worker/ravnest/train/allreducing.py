"""Ring all-reduce over gRPC (or the TCP data plane of dataplane.py): the nodes that hold the same
parameters in different clusters average them (reduce-scatter, then all-gather), with the mean
written back only if the round completes.

A ring round that misses a peer for longer than the timeout is *skipped*: local tensors keep their
values, the round is counted as skipped, and pieces of it that arrive late are dropped.

Given who is absent (`lost`: a watch of the ring's members, run/assembling.py, and the rejoins of
restarted ones, train/rejoining.py), a round is held among
the members present: its ring closes over them in the plan's order, the mean is theirs, and the
round records who was missing (`RingReducer.missing`). A loss reported while a round waits fails
that round at once (`Inbox.interrupt_ring`) instead of after the timeout (except the final round,
which members leave as soon as it is over for them). Each round's pieces carry
a tag of its membership in the high bits of their phase, so that two members that disagree for a
moment on who is present (one saw the loss a second before the other) never add up pieces cut for
different rings: they miss each other's pieces, and the round is skipped.

With `compression: int8` (and an outer optimizer), the pseudo-gradients go as int8 codes with a
scale per block and error feedback (`_Coder`); everything else in a ring goes as float32.
"""

from __future__ import annotations

import itertools
import logging
import zlib
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from ravnest.comm.dataplane import RingLink
from ravnest.comm.framing import ALIGN, COMPRESSIONS, Frame
from ravnest.comm.inboxes import Inbox
from ravnest.comm.quantizing import blocks, dequantize, quantize
from ravnest.comm.sending import RingSender
from ravnest.errors import TransportError
from ravnest.plan.plans import RingPlan

log = logging.getLogger(__name__)

FINAL_ROUND = 2**40
"""Round id of the reduce every node joins after training."""

PIECE_BYTES = 4 << 20
"""fp32 bytes per ring piece: small enough to overlap the hops, large enough that per-call gRPC
overhead stays small."""


MAX_TAIL = 1 << 18
"""Most elements `average` copies through the tail of the buffer it moves tensors into (integer
buffers, say): more (averaged optimizer state) and it copies everything instead, since the moved
tensors share that buffer and `torch.save` of one of them writes all of it."""


TAG_SHIFT = 32
"""A round's membership tag sits above this bit of its pieces' phase (0: every member present)."""


def membership_tag(members: Sequence[str], planned: Sequence[str]) -> int:
    """The tag of a round among `members` of a ring planned with `planned`: 0 when all are there,
    else 24 bits of a checksum of the names (never 0)."""
    if tuple(members) == tuple(planned):
        return 0
    return (zlib.crc32("\0".join(members).encode()) & 0xFFFFFF) or 1


def _flatten(tensors: Sequence[torch.Tensor], buffer: torch.Tensor | None,
             offset: int = 0) -> torch.Tensor:
    """One float32 copy of all tensors, back to back (the ring works on the copy), from element
    `offset` of `buffer` on when it has the right size: a buffer reused round after round costs
    no page faults. Device tensors come over in one go: into pinned host memory, without a wait
    per tensor, then one wait for them all."""
    numel = offset + sum(t.numel() for t in tensors)
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    if buffer is None or buffer.numel() != numel:
        buffer = torch.empty(numel, dtype=torch.float32, pin_memory=bool(devices))
    quick = bool(devices) and buffer.is_pinned()
    with torch.no_grad():
        for t in tensors:
            buffer[offset:offset + t.numel()].copy_(t.detach().reshape(-1), non_blocking=quick)
            offset += t.numel()
    for device in devices:
        torch.cuda.synchronize(device)
    return buffer


def _movable(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.layout == torch.strided and t.is_leaf


def _overlap(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether any two tensors share memory (one weight under two names, or a view of another)."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.element_size() * (
        1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))))
        for t in tensors if t.numel())
    return any(start < end for (_, end), (start, _) in itertools.pairwise(spans))


def _homed_in(tensors: Sequence[torch.Tensor], buffer: torch.Tensor | None) -> bool:
    """Whether the tensors are, in order, contiguous views back to back from `buffer`'s start."""
    if buffer is None:
        return False
    base, offset = buffer.untyped_storage().data_ptr(), buffer.storage_offset()
    for t in tensors:
        if (t.untyped_storage().data_ptr() != base or t.storage_offset() != offset
                or not t.is_contiguous()):
            return False
        offset += t.numel()
    return True


def _point(tensors: Sequence[torch.Tensor], buffer: torch.Tensor) -> None:
    """Make each tensor (its `.data`: a Parameter stays the same object, for its optimizer) a
    view of `buffer`, back to back from its start."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.data = buffer[offset:offset + t.numel()].view(t.shape)
            offset += t.numel()


def _unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor], offset: int = 0) -> None:
    """Write `flat` back into the tensors (to a device without a wait: the copies are queued on
    its stream before any later use of them, and before `_flatten` writes the buffer again)."""
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            piece = flat[offset:offset + n].view(t.shape)
            if not t.dtype.is_floating_point:
                piece = piece.round()
            t.copy_(piece.to(t.dtype), non_blocking=t.device.type == "cuda")
            offset += n


class RingReducer:
    """One node's part in one ring."""

    def __init__(self, ring: RingPlan, me: str, peers: Mapping[str, RingSender], inbox: Inbox,
                 timeout: float, sender: str = "", compression: str = "none",
                 piece_bytes: int = PIECE_BYTES,
                 lost: Callable[[int], Collection[str]] | None = None) -> None:
        """`peers`: a sender to this node's successor on the ring, and, given `lost` (the
        members a round goes without, asked with the round's number as it begins), to every
        member that may
        become its successor when others are missing."""
        self.ring = ring
        self.me = me
        self._peers = peers
        self._lost = lost
        self.members: tuple[str, ...] = ()
        """The members of the last round (the plan's, less the missing ones)."""
        self.missing: tuple[str, ...] = ()
        """The ring's members the last round went without."""
        self.rank = self.size = self._tag = 0
        self._next: RingSender | None = None
        self._grown: tuple[int, RingPlan] | None = None
        """(round, ring): the ring with a newcomer's node, from that round on (`extend`)."""
        self._form(ring.members)
        self._inbox = inbox
        self._timeout = timeout
        self._sender = sender or me
        self._int8 = compression == "int8"
        self._wire = None if self._int8 else COMPRESSIONS[compression]
        self._q = 0
        """int8: elements at the start of this round's buffer that go as codes (`average`'s
        quantized tensors); the others go as they are."""
        self._feedback = torch.empty(0)
        """int8: what this node's rounding lost in the last round that completed, added to its
        quantized elements in the next (error feedback); `_fresh`, this round's."""
        self._fresh = torch.empty(0)
        self._room = torch.empty(0, dtype=torch.uint8)
        """int8: room for the bytes of a round's pieces."""
        self._piece = max(1, piece_bytes // 4)  # float32 elements per piece
        self._flat: torch.Tensor | None = None
        self._live: torch.Tensor | None = None
        """The buffer the movable tensors live in (views), and the one the next round writes."""
        self._spare: torch.Tensor | None = None
        self._scratch = torch.empty(0)
        """float32 room for one received piece of another dtype (bf16 on the wire), converted
        there before it is added: torch's mixed-dtype add is ~10x slower than the two passes."""
        self._wired = torch.empty(0, dtype=self._wire or torch.float32)
        """The gathered pieces this node owns, in the wire's dtype, as they are posted."""

    def _form(self, members: tuple[str, ...]) -> None:
        """Close the ring over `members` (this node among them), in the plan's order."""
        self.members, self.rank, self.size = members, members.index(self.me), len(members)
        self.missing = tuple(m for m in self.ring.members if m not in members)
        self._tag = membership_tag(members, self.ring.members)
        self._next = None
        if self.size > 1:
            successor = members[(self.rank + 1) % self.size]
            if successor not in self._peers:
                raise TransportError(f"ring {self.ring.id}: no link to {successor}, this "
                                     f"node's successor while {', '.join(self.missing)} "
                                     f"{'is' if len(self.missing) == 1 else 'are'} missing")
            self._next = self._peers[successor]

    def extend(self, ring: RingPlan, from_round: int) -> None:
        """From round `from_round` on, the ring is `ring`: this one with a node of a cluster
        added to the running job (issue 20, grow). Every member switches at the same round (the
        one the newcomer joins at), so that their membership tags agree."""
        self._grown = (from_round, ring)

    def _begin(self, round_: int) -> None:
        """Form the round's ring over the members present (when a watch says who is lost)."""
        if self._grown is not None and round_ >= self._grown[0]:
            self.ring, self._grown = self._grown[1], None
            self.members = ()  # (formed again: its tag is the grown ring's)
        if self._lost is None:
            if not self.members:
                self._form(self.ring.members)
            return
        # resumed before the lost are read: a loss reported in between fails this round at
        # worst (skipped), where the other order could leave it waiting out the timeout. The
        # final round is not failed by a loss: members leave once it is over for them.
        self._inbox.resume_ring(self.ring.id, interruptible=round_ != FINAL_ROUND)
        lost = set(self._lost(round_))
        members = tuple(m for m in self.ring.members if m == self.me or m not in lost)
        if members != self.members:
            missing = [m for m in self.ring.members if m not in members]
            log.warning("ring %s from round %d on: %d of %d members (%s)", self.ring.id, round_,
                        len(members), len(self.ring.members),
                        f"without {', '.join(missing)}" if missing else "all back")
            self._form(members)

    def average(self, tensors: Sequence[torch.Tensor], round_: int, movable: int = 0,
                quantized: int = 0) -> bool:
        """Average `tensors` in place with the other members; False if the round was skipped
        (then every tensor keeps its value, but for the first `quantized`: `_quantized`).

        The first `movable` tensors are their caller's own (a stage's parameters and buffers,
        not detached aliases of them): those that are float32 on the CPU are moved to live as
        views of a buffer this reducer keeps (`.data` changes, the objects stay). The ring then
        reads them in place and writes the mean to a second buffer, which they are pointed at
        when the round completes, instead of copying everything in and out. The other tensors
        are copied in and out (through the buffer's tail, or, when they hold more than
        MAX_TAIL elements, all tensors are copied as if none were movable).

        With the other members all missing, the average of those present is this node's own
        tensors: True, and `missing` names them."""
        self._q = self._quantized(tensors[:min(quantized, movable)])
        try:
            self._begin(round_)
        except TransportError as e:
            log.warning("ring %s round %d skipped: %s", self.ring.id, round_, e)
            return False
        if self.size == 1:
            return True
        # the order on the ring depends only on dtypes: the same on every member, moved or not
        homed = [t for t in tensors[:movable] if t.dtype == torch.float32]
        ids = {id(t) for t in homed}
        rest = [t for t in tensors if id(t) not in ids]
        at_home = _homed_in(homed, self._live)
        can_move = at_home or (all(_movable(t) for t in homed) and not _overlap(homed))
        tail = sum(t.numel() for t in rest)
        if not can_move or tail > MAX_TAIL:
            # not a CPU leaf; aliases (tied weights, which moving would untie); or a large tail
            # (averaged optimizer state), which the moved tensors' buffer would hold and every
            # stage file would save with them: copy them all
            rest, homed = homed + rest, []
        if not homed:
            flat = self._flat = _flatten(rest, self._flat)
            if not self._round(flat, flat, round_):
                return False
            _unflatten(flat, rest)
            return True
        n = sum(t.numel() for t in homed)
        live = self._live
        if live is None or not at_home or live.numel() != n + tail:
            # the first round, or the tensors were replaced since: move them (one copy)
            live = torch.empty(n + tail)
            _flatten(homed + rest, live)
            _point(homed, live)
        else:
            _flatten(rest, live, n)  # the others in the buffer's tail
        spare = self._spare
        if spare is None or spare.numel() != live.numel():
            spare = torch.empty_like(live)
        self._live, self._spare = live, spare
        if not self._round(live, spare, round_):
            return False
        _point(homed, spare)
        _unflatten(spare, rest, n)
        self._live, self._spare = spare, live
        return True

    def _quantized(self, tensors: Sequence[torch.Tensor]) -> int:
        """int8: the elements of `tensors` that go as codes, the leading float32 ones (the ring's
        buffer begins with them; `average`'s first `quantized`, among its movable ones: an outer
        step's pseudo-gradients, written anew each round). With error feedback: what this
        node's rounding lost in the last round is added to them first (in place, whether this
        round completes or not). The others go as float32."""
        q = 0
        for t in tensors if self._int8 else ():
            if t.dtype != torch.float32:
                break
            q += t.numel()
        return q

    def _round(self, src: torch.Tensor, dst: torch.Tensor, round_: int) -> bool:
        try:
            self._reduce(src, dst, round_)
        except TransportError as e:
            log.warning("ring %s round %d skipped: %s", self.ring.id, round_, e)
            return False
        return True

    def all_reduce_(self, flat: torch.Tensor, round_: int, quantized: bool = False) -> None:
        """Average one contiguous float32 tensor in place with the other members, without the
        copy in and out by which `average` keeps its tensors untouched by a failed round: here a
        failed round raises TransportError and leaves `flat` partly reduced. For callers that
        hold their own buffer (and for measuring the ring alone against gloo's all_reduce).
        `quantized`: with int8 compression, all of it goes as codes (with error feedback)."""
        self._q = flat.numel() if self._int8 and quantized else 0
        if flat.dtype != torch.float32 or not flat.is_contiguous() or flat.dim() != 1:
            raise ValueError("all_reduce_ takes a contiguous 1-d float32 tensor")
        self._begin(round_)
        if self.size == 1:
            return
        self._reduce(flat, flat, round_)

    def _reduce(self, src: torch.Tensor, dst: torch.Tensor, round_: int) -> None:
        """The ring from `src` into `dst`; after a failure, drop the round's late pieces, stop
        receptions into `dst` and the link reading either (the next round reuses them), then
        raise."""
        try:
            self._all_reduce(src, dst, round_)
        except TransportError:
            self._inbox.forget_rounds_before(self.ring.id, round_ + 1)
            if isinstance(self._next, RingLink):
                self._next.abort()
            raise
        finally:
            self._inbox.expect(self.ring.id, round_, {})  # a completed round leaves no offer

    def _all_reduce(self, src: torch.Tensor, dst: torch.Tensor, round_: int) -> None:
        """Reduce-scatter then all-gather, pipelined piece by piece: each of the n segments is cut
        into pieces, and a piece goes on to the next node as soon as it is reduced (or gathered)
        here, so sending, receiving and adding overlap along the ring instead of each step
        waiting for a whole segment.

        `src` is only read (this node's segment is sent from it, and each received partial sum
        is added to it into `dst`); every element of `dst` is written. They may be one tensor."""
        n, r = self.size, self.rank

        def cut(flat: torch.Tensor) -> list[list[torch.Tensor]]:
            return [list(seg.split(self._piece)) for seg in flat.tensor_split(n)]

        mine, pieces = cut(src), cut(dst)
        per = max(len(p) for p in pieces)  # phase id = ring step * per + piece

        tag = self._tag << TAG_SHIFT

        def phase(step: int, k: int) -> int:
            return tag | (step * per + k)

        coder = self._coder(src, n * per) if self._int8 else None
        wired = self._landing(pieces, round_, phase, coder)
        at = [[int(p.storage_offset() - dst.storage_offset()) for p in seg] for seg in pieces]

        def post(kind: str, piece: torch.Tensor, seg: int, k: int, step: int,
                 owner: bool = False) -> None:
            """`owner`: the piece is the mean, which this node rounds as the others get it
            (int8: n times its loss fed back, at the piece's offset in the buffers, `at`)."""
            if coder is not None:
                tensors = coder.encode(piece, at[seg][k], float(n) if owner else 1.0)
            else:
                tensors = {"x": self._like_wire(piece, next(wired, None)) if owner else piece}
            self._post(kind, tensors, round_, phase(step, k))

        for k, piece in enumerate(mine[r]):
            post("reduce", piece, r, k, 0)
        for s in range(n - 1):
            last = s == n - 2
            seg = (r - s - 1) % n
            for k, piece in enumerate(pieces[seg]):
                self._take(round_, phase(s, k), piece, add_to=mine[seg][k], coder=coder,
                           at=at[seg][k])
                if not last:
                    post("reduce", piece, seg, k, s + 1)
                    continue
                # fully reduced here: this node owns the piece's mean and starts its gather
                piece.div_(n)
                post("gather", piece, seg, k, n - 1, owner=True)
        for s in range(n - 1):
            seg = (r - s) % n
            for k, piece in enumerate(pieces[seg]):
                forward = self._take(round_, phase(n - 1 + s, k), piece, coder=coder,
                                     at=at[seg][k], keep=s < n - 2)
                if s < n - 2:
                    self._post("gather", forward or {"x": piece}, round_, phase(n + s, k))
        assert self._next is not None
        self._next.flush(self._timeout)
        if coder is not None:  # the round is done: its losses are fed back in the next
            self._feedback, self._fresh = self._fresh, self._feedback

    def _landing(self, pieces: list[list[torch.Tensor]], round_: int,
                 phase: Callable[[int, int], int], coder: _Coder | None
                 ) -> Iterator[torch.Tensor]:
        """Where the pieces this node owns are rounded to the wire's dtype and posted; on a data
        plane link with float32 pieces, the gathered pieces land in place instead (received
        straight into their piece of the buffer, no copy)."""
        n, r = self.size, self.rank
        if self._wire is not None:
            sizes = [p.numel() for p in pieces[(r + 1) % n]]
            if self._wired.numel() < sum(sizes):
                self._wired = torch.empty(sum(sizes), dtype=self._wire)
            return iter(self._wired[:sum(sizes)].split(sizes))
        if coder is None and isinstance(self._next, RingLink):
            self._inbox.expect(self.ring.id, round_, {
                phase(n - 1 + s, k): piece
                for s in range(n - 1) for k, piece in enumerate(pieces[(r - s) % n])})
        return iter(())

    def _coder(self, src: torch.Tensor, pieces: int) -> _Coder:
        """This round's int8 coder, after the last completed round's losses are added to the
        quantized elements of `src`."""
        q = self._q
        if self._feedback.numel() != q:
            self._feedback, self._fresh = torch.zeros(q), torch.zeros(q)
        with torch.no_grad():
            src[:q].add_(self._feedback)
        self._fresh.zero_()
        room = _Coder.room(q, src.numel(), pieces)
        if self._room.numel() < room:
            self._room = torch.empty(room, dtype=torch.uint8)
        return _Coder(self.ring.id, q, self._fresh, self._room[:room], self._scratch_for)

    def _scratch_for(self, n: int) -> torch.Tensor:
        if self._scratch.numel() < n:
            self._scratch = torch.empty(n)
        return self._scratch[:n]

    def _like_wire(self, piece: torch.Tensor, wired: torch.Tensor | None) -> torch.Tensor:
        """A fully reduced piece as the wire carries it: rounded to the wire's dtype into `wired`
        (its slot in a buffer that lives until the round is over, posted as it is: nothing to
        convert again when it is sent), and the piece set to that, so its owner keeps what the
        others receive. float16 cannot hold a piece over 65504: framing sends such a tensor
        uncompressed, and so it stays."""
        if self._wire is None or wired is None:
            return piece
        if self._wire == torch.float16 and piece.numel() and piece.abs().max().item() > 65504.0:
            return piece
        wired = wired.view(piece.shape).copy_(piece)
        piece.copy_(wired)
        return wired

    def _post(self, kind: str, tensors: dict[str, torch.Tensor], round_: int,
              phase: int) -> None:
        assert self._next is not None
        self._next.post(Frame(kind=kind, tensors=tensors, step=round_, version=phase,
                              ring=self.ring.id, sender=self._sender), ordered=False)

    def _take(self, round_: int, phase: int, piece: torch.Tensor,
              add_to: torch.Tensor | None = None, coder: _Coder | None = None, at: int = 0,
              keep: bool = False) -> dict[str, torch.Tensor] | None:
        """Write the awaited piece plus `add_to` into `piece`, or (no `add_to`) the piece alone.
        Given `coder` (int8: the piece at offset `at` of the buffer) and `keep`, the piece's
        tensors to pass on as they came."""
        frame = self._inbox.take_ring(self.ring.id, round_, phase, self._timeout)
        try:
            if coder is not None:
                return coder.take(frame, piece, at, add_to, keep)
            x = frame.tensors.get("x")
            if x is None or x.shape != piece.shape:
                raise TransportError(f"ring {self.ring.id}: piece of shape "
                                     f"{None if x is None else tuple(x.shape)} from "
                                     f"{frame.sender}, expected {tuple(piece.shape)}")
            if add_to is not None:
                if x.dtype != piece.dtype:
                    x = self._scratch_for(x.numel()).view(x.shape).copy_(x)
                torch.add(add_to, x, out=piece)
            elif x is not piece:  # (a piece that landed in place is there already)
                piece.copy_(x)
            return None
        finally:
            if frame.release is not None:
                frame.release()  # the data plane reuses the buffer for a later piece


class _Coder:
    """One int8 round's pieces (`training.compression: int8`, comm/quantizing.py): a piece is
    one uint8 tensor `x`, bytes that no link rounds to its wire dtype: the scales (float32) of
    its first elements that are among the first `q` of the ring's buffer, then its other
    elements (float32), then the codes (int8) of the first ones.

    Error feedback: what a piece's rounding loses, where this node rounds it, is added into
    `fresh` at the piece's place (n times over for a mean's rounding, which all n members take).
    The sum over a ring's members of what the round lost is then exactly the sum of their
    `fresh`, which they add to their next round's quantized elements: over the rounds, no
    rounding error is lost, it is only late. A node that owns a mean keeps it rounded as the
    others receive it, and the others pass its bytes on as they got them, so all hold the same
    values."""

    def __init__(self, ring: str, q: int, fresh: torch.Tensor, room: torch.Tensor,
                 scratch: Callable[[int], torch.Tensor]) -> None:
        self.ring, self.q, self.fresh = ring, q, fresh
        self._room, self._scratch = room, scratch
        self._at = 0
        """Where the next piece's bytes go in `room` (which lives until the round's pieces are
        sent)."""

    @staticmethod
    def room(q: int, numel: int, pieces: int) -> int:
        """Bytes a round's pieces take at most: each piece of a buffer of `numel` elements (the
        first `q` quantized, cut into `pieces`) is posted at most twice."""
        return 2 * (q + 4 * (numel - q) + 4 * (blocks(q) + pieces) + ALIGN * pieces)

    def _layout(self, piece: torch.Tensor, at: int) -> tuple[int, int, int]:
        """The quantized elements of `piece` (at offset `at` of the buffer), and where its raw
        elements and its codes begin in its bytes."""
        k = max(0, min(self.q - at, piece.numel()))
        raw = 4 * blocks(k)
        return k, raw, raw + 4 * (piece.numel() - k)

    def _bytes(self, n: int) -> torch.Tensor:
        out = self._room[self._at:self._at + n]
        self._at += -(-n // ALIGN) * ALIGN  # (the scales and raw elements stay aligned)
        return out

    def encode(self, piece: torch.Tensor, at: int, weight: float) -> dict[str, torch.Tensor]:
        """The tensors of `piece` (at offset `at` of the buffer), its rounding loss times
        `weight` fed back; when `weight` is not 1 (a mean), the piece is set to its rounding."""
        k, raw, codes_at = self._layout(piece, at)
        out = self._bytes(codes_at + k)
        with torch.no_grad():
            out[raw:codes_at].view(torch.float32).copy_(piece[k:])
            if k:
                codes = out[codes_at:].view(torch.int8)
                scales = out[:raw].view(torch.float32)
                quantize(piece[:k], codes, scales)
                rounded = dequantize(codes, scales, self._scratch(k))
                lost = self.fresh[at:at + k]
                lost.add_(piece[:k], alpha=weight).sub_(rounded, alpha=weight)
                if weight != 1.0:
                    piece[:k].copy_(rounded)
        return {"x": out}

    def take(self, frame: Frame, piece: torch.Tensor, at: int, add_to: torch.Tensor | None,
             keep: bool) -> dict[str, torch.Tensor] | None:
        """Write a received piece (at offset `at` of the buffer) plus `add_to` into `piece`;
        given `keep`, its tensors to pass on (its bytes copied out of the frame, whose buffer
        goes back to the link)."""
        k, raw, codes_at = self._layout(piece, at)
        x = frame.tensors.get("x")
        if (len(frame.tensors) != 1 or x is None or x.dtype != torch.uint8
                or x.shape != (codes_at + k,)):
            raise TransportError(
                f"ring {self.ring}: int8 piece from {frame.sender} is "
                f"{ {n: (str(t.dtype), tuple(t.shape)) for n, t in frame.tensors.items()} }, "
                f"expected {{'x': ('torch.uint8', ({codes_at + k},))}}")
        if x.storage_offset() % 4:  # (raw bytes where float32 cannot be read in place)
            x = x.clone()
        values = x[raw:codes_at].view(torch.float32)
        with torch.no_grad():
            if add_to is not None:
                torch.add(add_to[k:], values, out=piece[k:])
            else:
                piece[k:].copy_(values)
            if k:
                got = dequantize(x[codes_at:].view(torch.int8), x[:raw].view(torch.float32),
                                 self._scratch(k))
                if add_to is not None:
                    torch.add(add_to[:k], got, out=piece[:k])
                else:
                    piece[:k].copy_(got)
        if not keep:
            return None
        return {"x": self._bytes(x.numel()).copy_(x)}


@dataclass
class Rounds:
    """What one round of each of a node's rings came to."""

    done: int = 0
    skipped: int = 0
    partial: int = 0
    """Rounds done (counted in `done` too) without some of their ring's members."""
    missing: int = 0
    """Members the node's rings went without, summed over its rings."""


def reduce_all(reducers: Sequence[tuple[RingReducer,
                                        Callable[[], tuple[list[torch.Tensor], int, int]]]],
               round_: int, settle: Callable[[RingReducer, bool], None] | None = None
               ) -> Rounds:
    """Run every ring of a node in ring-id order (deadlock-free). Each ring's callable gives its
    tensors, how many of the first are movable and how many of those may be quantized
    (`average`); `settle` is told each ring's
    outcome (done or skipped) as it comes, before the next ring's tensors are asked for."""
    out = Rounds()
    for reducer, tensors in sorted(reducers, key=lambda x: x[0].ring.id):
        ts, movable, quantized = tensors()
        done = reducer.average(ts, round_, movable, quantized)
        if done:
            out.done += 1
            out.partial += bool(reducer.missing)
        else:
            out.skipped += 1
        out.missing += len(reducer.missing)
        if settle is not None:
            settle(reducer, done)
    return out
