"""A worker's gRPC server on its own, for the fuzz tests: `python fuzz_server.py TOKEN PLAN LIMIT`.

It runs the real `transport.Server` (Peer.Send and the health service, default thread pool) with a
real `Inbox`, whose frames are taken as soon as they are delivered, as a worker's compute thread
takes them. It prints its port, serves until its stdin closes, then prints one JSON line: how many
frames of each kind were delivered and a digest of the last one.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
from collections import Counter

import torch

from ravnest.comm.framing import Frame
from ravnest.comm.inboxes import Inbox
from ravnest.comm.transport import Credentials, Server
from ravnest.errors import PeerTimeout


def digest(frame: Frame) -> str:
    """What the frame holds: header fields, control, and each tensor's name, dtype, shape, bytes."""
    h = hashlib.sha256(json.dumps([frame.kind, frame.step, frame.microbatch, frame.version,
                                   frame.ring, frame.sender, frame.control]).encode())
    for name, tensor in frame.tensors.items():
        h.update(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode())
        h.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    token, plan, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
    inbox = Inbox(capacity=80)
    lock = threading.Lock()
    delivered: Counter[str] = Counter()
    last: list[str] = [""]

    def deliver(frame: Frame) -> None:
        with lock:
            inbox.deliver(frame)
            if frame.kind in ("reduce", "gather"):
                try:
                    inbox.take_ring(frame.ring, frame.step, frame.version, timeout=0)
                except PeerTimeout:
                    pass
            else:
                inbox.pipeline.get_nowait()
            delivered[frame.kind] += 1
            last[0] = digest(frame)

    server = Server("127.0.0.1:0", Credentials(token, plan), deliver, max_frame_bytes=limit)
    server.start()
    print(server.port, flush=True)
    sys.stdin.read()
    server.stop(grace=0)
    print(json.dumps({"delivered": dict(delivered), "last": last[0]}), flush=True)


if __name__ == "__main__":
    main()
