"""Inboxes: where a worker's server puts the frames it receives until the compute thread takes
them, so that receiving (gRPC server threads, the data plane's readers) and computing never wait
on each other.

The pipeline's frames queue in arrival order, put back in their sender's order where they were
numbered; ring pieces wait by key for the ring step that needs them, or land straight in the
tensor a step offered. Both transports (transport.py, dataplane.py) deliver into the same Inbox,
so timeouts, skipped rounds and late pieces behave the same on both.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch

from ravnest.comm.framing import Frame
from ravnest.errors import PeerTimeout, shown

ORDER_WINDOW = 64
"""Numbered frames a stream may be ahead of the one its receiver waits for (a Peer has at most
1 + transport.UNORDERED_LANES calls in flight, so more means a broken or hostile sender):
refused."""
LANDING_CANCEL_SECONDS = 10.0
"""How long a given-up round waits for a reception into its tensors to stop once its connection
was shut down (that takes milliseconds: a stuck one means the tensor could still be written)."""


class Inbox:
    """Frames delivered by the server, waiting for the compute thread.

    Pipeline frames (forward, backward, eval, control) go to one FIFO in arrival order, bounded so a
    fast sender gets backpressure. Ring frames are keyed by (ring, round, phase step) so a ring
    step can wait for exactly the piece it needs. A ring's pieces all come from one peer, which
    starts a round only once the one before is over for it: completed, and then all its pieces
    were delivered (flushed), or given up. So once a piece of a later round is here while one of
    an earlier round is awaited, the peer gave that round up (it ran ahead while this node was cut
    off or slow) and it cannot complete here either: waiting it out would only keep this node
    behind, round after round, instead of letting it catch up and rejoin.

    Numbered frames (a Peer's ordered posts, which travel on several calls at once) are handed on
    in their stream's order: one that arrives early waits here, without holding a server thread,
    until the ones before it are in.

    A ring step may also offer the tensor a piece belongs in (`expect`): the data plane's reader
    then receives that piece straight into it (`claim`, `landed`) instead of into a buffer the
    step would copy from. An offer lives until its round ends; a round given up
    (`forget_rounds_before`) first stops every reception still writing into its tensors.
    """

    def __init__(self, capacity: int = 64) -> None:
        self.pipeline: queue.Queue[Frame] = queue.Queue(maxsize=capacity)
        self._ring: dict[tuple[str, int, int], Frame] = {}
        self._ring_cond = threading.Condition()
        self._min_round: dict[str, int] = {}
        self._newest_round: dict[str, int] = {}
        self._order = threading.Lock()
        """Held while numbered frames are handed on, so that they leave in order."""
        self.control_ops: set[str] = set()
        """The `op` of every control frame delivered so far (read before the loop starts: a
        neighbour that said training is over may already be gone)."""
        self._expected: dict[int, int] = {}
        self._early: dict[int, dict[int, Frame]] = {}
        self._landings: dict[tuple[str, int, int], torch.Tensor] = {}
        self._receiving: dict[tuple[str, int, int], Callable[[], None]] = {}
        self._interrupted: dict[str, str] = {}
        """Why a ring's current round cannot complete (a member was lost), by ring."""
        self._uninterruptible: set[str] = set()
        """Rings whose current round waits on whatever is reported (`resume_ring`)."""

    def deliver(self, frame: Frame) -> None:
        if frame.kind not in ("reduce", "gather", "forward", "backward", "eval", "control"):
            raise ValueError(f"unknown frame kind {shown(frame.kind)}")
        if not frame.sequence:
            self._hand_on(frame)
            return
        with self._order:
            want = self._expected.get(frame.stream, 1)
            early = self._early.get(frame.stream, {})
            if frame.sequence < want or frame.sequence in early:
                raise ValueError(f"frame {frame.sequence} of stream {frame.stream} came twice")
            if frame.sequence >= want + ORDER_WINDOW:
                raise ValueError(f"frame {frame.sequence} of stream {frame.stream} is more than "
                                 f"{ORDER_WINDOW} ahead of {want}")
            early[frame.sequence] = frame
            while want in early:
                # the queue may block here (backpressure): later frames wait for the lock
                self._hand_on(early.pop(want))
                want += 1
            self._expected[frame.stream] = want
            if early:
                self._early[frame.stream] = early
            else:
                self._early.pop(frame.stream, None)  # a refused frame leaves nothing behind

    def _hand_on(self, frame: Frame) -> None:
        if frame.kind in ("reduce", "gather"):
            with self._ring_cond:
                if frame.step < self._min_round.get(frame.ring, 0):
                    return
                self._ring[(frame.ring, frame.step, frame.version)] = frame
                self._newest_round[frame.ring] = max(frame.step,
                                                     self._newest_round.get(frame.ring, 0))
                self._ring_cond.notify_all()
        else:
            if frame.kind == "control" and isinstance(frame.control.get("op"), str):
                self.control_ops.add(frame.control["op"])
            self.pipeline.put(frame)

    def take_ring(self, ring: str, round_: int, phase_step: int, timeout: float) -> Frame:
        deadline = time.monotonic() + timeout
        key = (ring, round_, phase_step)
        with self._ring_cond:
            while key not in self._ring:
                if ring in self._interrupted and ring not in self._uninterruptible:
                    raise PeerTimeout(f"ring {ring} round {round_}: "
                                      f"{self._interrupted[ring]}")
                newest = self._newest_round.get(ring, 0)
                if newest > round_:
                    raise PeerTimeout(f"ring {ring} round {round_}: the peer already moved on to "
                                      f"round {newest}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerTimeout(f"ring {ring} round {round_}: no data for step "
                                      f"{phase_step} within {timeout:.0f}s")
                self._ring_cond.wait(left)
            return self._ring.pop(key)

    def interrupt_ring(self, ring: str, reason: str) -> None:
        """Fail the ring's waits for pieces, the one under way and those to come, with `reason`
        (a member of the round is gone: waiting out the timeout would gain nothing), until
        `resume_ring`."""
        with self._ring_cond:
            self._interrupted[ring] = reason
            self._ring_cond.notify_all()

    def resume_ring(self, ring: str, interruptible: bool = True) -> None:
        """Let the ring's waits for pieces wait again (a round among the members left begins);
        not `interruptible`: until the next call, whatever `interrupt_ring` says (the last round
        of a run, whose members leave as soon as it is over for them: one that leaves has sent
        all its pieces, and the others can still complete)."""
        with self._ring_cond:
            self._interrupted.pop(ring, None)
            if interruptible:
                self._uninterruptible.discard(ring)
            else:
                self._uninterruptible.add(ring)

    def forget_rounds_before(self, ring: str, round_: int) -> None:
        """Drop stale pieces of skipped rounds, and refuse late ones; withdraw their offered
        tensors, cutting off any reception still writing into one (its connection is shut down:
        its sender fails the round and connects again), and return once none is."""
        with self._ring_cond:
            self._min_round[ring] = round_
            for key in [k for k in self._ring if k[0] == ring and k[1] < round_]:
                del self._ring[key]
            for key in [k for k in self._landings if k[0] == ring and k[1] < round_]:
                del self._landings[key]
            busy = [cancel for k, cancel in self._receiving.items()
                    if k[0] == ring and k[1] < round_]
        for cancel in busy:
            cancel()
        deadline = time.monotonic() + LANDING_CANCEL_SECONDS
        with self._ring_cond:
            while any(k[0] == ring and k[1] < round_ for k in self._receiving):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"ring {ring}: a reception into round {round_ - 1}'s "
                                       f"tensors did not stop within {LANDING_CANCEL_SECONDS}s")
                self._ring_cond.wait(left)

    def expect(self, ring: str, round_: int, landings: dict[int, torch.Tensor]) -> None:
        """Offer where the pieces (ring, round_, phase) belong, by phase, replacing the ring's
        earlier offers (`{}` withdraws them). The caller must not touch an offered tensor until
        the piece was taken or the round forgotten."""
        with self._ring_cond:
            for key in [k for k in self._landings if k[0] == ring]:
                del self._landings[key]
            for phase, tensor in landings.items():
                self._landings[(ring, round_, phase)] = tensor

    def claim(self, ring: str, round_: int, phase: int, dtype: torch.dtype, numel: int,
              cancel: Callable[[], None]) -> torch.Tensor | None:
        """The offered tensor for an arriving piece of this dtype and size, or None: receive it
        into a buffer as usual (also for an offered tensor that is not contiguous, which a
        receiver could not write in place). The receiver must call `landed` when its reception
        ends, whether it completed or failed; `cancel` must make a reception stuck on its
        connection fail."""
        key = (ring, round_, phase)
        with self._ring_cond:
            tensor = self._landings.get(key)
            if (tensor is None or tensor.dtype != dtype or tensor.numel() != numel
                    or not tensor.is_contiguous() or round_ < self._min_round.get(ring, 0)):
                return None
            del self._landings[key]
            self._receiving[key] = cancel
            return tensor

    def landed(self, ring: str, round_: int, phase: int) -> None:
        with self._ring_cond:
            self._receiving.pop((ring, round_, phase), None)
            self._ring_cond.notify_all()
