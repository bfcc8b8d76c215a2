"""Tensor frames: named tensors <-> raw bytes with a typed header. Never pickle.

A frame is a header (kind, step, ids, one TensorMeta per tensor) and a payload: the tensors' raw
bytes laid out back to back at 64-byte aligned offsets. On the wire a frame is a stream of ~1 MiB
chunks. The receiver checks the header (dtypes, shapes, offsets, total size against its limit)
before it allocates anything, then copies each chunk straight into one preallocated buffer and
rebuilds the tensors as views of it. A server's buffers for large frames come from a
`BufferPool` (buffers.py), which hands a buffer out again once nothing refers to its frame.

Optional compression sends float32 tensors as bfloat16 or float16 (but a control frame's, state,
EXACT_KINDS). float16 cannot hold values beyond +-65504: such a tensor is sent uncompressed
rather than silently clamped.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from google.protobuf.message import DecodeError

from ravnest.comm.buffers import BufferPool
from ravnest.comm.proto import ravnest_pb2 as pb
from ravnest.errors import TransportError, shown

CHUNK_BYTES = 1 << 20
ALIGN = 64
DEFAULT_MAX_FRAME_BYTES = 1 << 30

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
NAMES = {v: k for k, v in DTYPES.items()}
COMPRESSIONS = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16,
                "int8": torch.bfloat16}
"""The float32 tensors' dtype on a link. `int8` is the rings' (train/allreducing.py: their
pieces are codes and integers, which no link rounds): the pipeline's tensors go as bfloat16."""
EXACT_KINDS = frozenset({"control"})
"""Frames whose tensors go as they are whatever the link's compression: a control frame's are a
node's state (a ring's handed to a node that rejoins, takes over or joins), which must arrive
as its sender holds it, not rounded like activations."""
MAX_DIMS = 16
_FP16_MAX = 65504.0
_MAX_EXTENT = 1 << 62
"""Bound on the product of a shape's non-zero dims: an empty tensor (some dim 0) has no payload,
but torch still cannot lay out dims whose product overflows int64."""


class FrameError(TransportError):
    """A frame is malformed, oversized or does not match its header."""


@dataclass
class Frame:
    """A decoded (or to-be-encoded) message between workers."""

    kind: str
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    step: int = 0
    microbatch: int = 0
    version: int = 0
    ring: str = ""
    sender: str = ""
    control: dict[str, Any] = field(default_factory=dict)
    stream: int = 0
    """Random id of the Peer that numbered this frame (see `sequence`)."""
    sequence: int = 0
    """1, 2, ... within `stream` for frames the receiver must take in order; 0: no order."""
    wire_bytes: int = 0
    """Payload bytes this frame took on the wire (set when decoded)."""
    release: Callable[[], None] | None = field(default=None, repr=False, compare=False)
    """Set by a receiver that lends the frame's buffers: call once done with the tensors (they
    are reused for later frames), and keep no reference to them afterwards."""
    ready: Callable[[], None] | None = field(default=None, repr=False, compare=False)
    """Set by a sender whose tensors (and control) are still being filled, copied from a device
    on a stream of their own: whoever reads them first calls it, once (it waits for the copies)."""

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def to_wire(t: torch.Tensor, compression: torch.dtype | None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """`t` as it goes on the wire: on the CPU, contiguous, and converted when compressed (into
    `out` when given: a reusable buffer of the wire dtype and t's element count)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if compression is not None and t.dtype == torch.float32:
        if compression == torch.float16 and t.numel() and t.abs().max().item() > _FP16_MAX:
            return t.contiguous()
        if out is not None:
            return out.view(t.shape).copy_(t)
        return t.to(compression).contiguous()
    return t.contiguous()


def check_sendable(frame: Frame) -> None:
    """Raise FrameError if the frame holds a tensor no frame can carry."""
    for name, tensor in frame.tensors.items():
        if tensor.dtype not in NAMES:
            raise FrameError(f"tensor {name!r}: dtype {tensor.dtype} cannot be sent")


def layout(frame: Frame, compression: str) -> tuple[pb.FrameHeader,
                                                   list[tuple[int, torch.Tensor]], int]:
    """The frame's header, its tensors' raw bytes at their payload offsets and the payload's
    size: what every encoding writes out."""
    check_sendable(frame)
    wire_dtype = None if frame.kind in EXACT_KINDS else COMPRESSIONS[compression]
    metas, views, offset = [], [], 0
    for name, tensor in frame.tensors.items():
        wire = to_wire(tensor, wire_dtype)
        metas.append(pb.TensorMeta(
            name=name, dtype=NAMES[tensor.dtype], shape=list(tensor.shape),
            wire_dtype="" if wire.dtype == tensor.dtype else NAMES[wire.dtype], offset=offset,
        ))
        raw = (wire.reshape(-1).view(torch.uint8) if wire.numel()
               else torch.empty(0, dtype=torch.uint8))
        views.append((offset, raw))
        offset = _aligned(offset + raw.numel())
    header = pb.FrameHeader(
        kind=frame.kind, step=frame.step, microbatch=frame.microbatch, version=frame.version,
        ring=frame.ring, sender=frame.sender, tensors=metas, payload_bytes=offset,
        stream=frame.stream, sequence=frame.sequence,
        control=json.dumps(frame.control, separators=(",", ":")) if frame.control else "",
    )
    return header, views, offset


def encode_wire(frame: Frame, compression: str = "none",
                chunk_bytes: int = CHUNK_BYTES) -> list[bytes]:
    """The frame as serialized `Chunk` messages, what gRPC sends: the header alone, then the
    payload. Each data message is written straight from the tensors' memory (one copy, no
    protobuf objects in between), so the list is also a snapshot of the tensors."""
    return list(iter_wire(frame, compression, chunk_bytes))


def encode_one(frame: Frame, compression: str = "none") -> bytes:
    """The whole frame as one serialized `Chunk` holding both its header and its payload, for
    frames small enough to go as one message: the payload is copied once, straight from the
    tensors' memory."""
    header, views, total = layout(frame, compression)
    parts: list[bytes | memoryview] = [pb.Chunk(header=header).SerializeToString()]
    if total:
        parts += [_DATA_TAG, _varint(total), *_segments(views, total)]
    return b"".join(parts)


def iter_wire(frame: Frame, compression: str = "none",
              chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """`encode_wire` one message at a time, so that sending starts before the whole frame is
    copied (the tensors must not change until the last message is taken)."""
    header, views, total = layout(frame, compression)
    yield pb.Chunk(header=header).SerializeToString()
    for pieces in payload_pieces(views, total, chunk_bytes):
        yield b"".join([_DATA_TAG, _varint(sum(map(len, pieces))), *pieces])


_DATA_TAG = b"\x12"
"""`Chunk.data` on the wire: field 2, length-delimited."""
_HEADER_TAG = b"\x0a"
"""`Chunk.header` on the wire: field 1, length-delimited."""


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _read_varint(message: bytes, i: int) -> tuple[int, int] | None:
    """The varint at `message[i:]` and the index after it, or None where there is none."""
    n = shift = 0
    for j in range(i, min(len(message), i + 10)):
        byte = message[j]
        n |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return n, j + 1
    return None


def _data_after(message: bytes, i: int) -> memoryview | None:
    """The data field that makes up all of `message[i:]`, sliced without a copy, or None."""
    if message[i:i + 1] != _DATA_TAG:
        return None
    length = _read_varint(message, i + 1)
    if length is None or length[1] + length[0] != len(message):
        return None
    return memoryview(message)[length[1]:]


def parse_chunk(message: bytes) -> tuple[pb.FrameHeader | None, memoryview | bytes]:
    """One serialized `Chunk`. A data-only message, and a header followed by data (what
    `encode_one` writes), are sliced without copying the data; anything else goes through
    protobuf."""
    data = _data_after(message, 0)
    if data is not None:
        return None, data
    if message[:1] == _HEADER_TAG:
        length = _read_varint(message, 1)
        if length is not None:
            end = length[1] + length[0]
            data = _data_after(message, end)
            if data is not None:
                try:
                    return pb.FrameHeader.FromString(message[length[1]:end]), data
                except DecodeError as e:
                    raise FrameError(f"chunk header is not a FrameHeader: {e}") from e
    try:
        chunk = pb.Chunk.FromString(message)
    except DecodeError as e:
        raise FrameError(f"chunk is not a Chunk message: {e}") from e
    return (chunk.header if chunk.HasField("header") else None), chunk.data


def _segments(views: list[tuple[int, torch.Tensor]], total: int) -> Iterator[memoryview]:
    """The payload in order: each tensor's bytes, with the zero padding that aligns the next."""
    position = 0
    for offset, raw in views:
        if offset > position:
            yield memoryview(bytes(offset - position))
        yield raw.numpy().data
        position = offset + raw.numel()
    if total > position:
        yield memoryview(bytes(total - position))


def payload_pieces(views: list[tuple[int, torch.Tensor]], total: int,
                   chunk_bytes: int) -> Iterator[list[memoryview]]:
    """The payload (as `layout` gives it) cut into chunks of `chunk_bytes` (the last one
    shorter), each given as the zero-copy views that make it up."""
    pending: list[memoryview] = []
    pending_len = 0
    for data in _segments(views, total):
        start = 0
        while start < len(data):
            take = min(chunk_bytes - pending_len, len(data) - start)
            pending.append(data[start:start + take])
            pending_len += take
            start += take
            if pending_len == chunk_bytes:
                yield pending
                pending, pending_len = [], 0
    if pending:
        yield pending


def _check_header(header: pb.FrameHeader, max_frame_bytes: int) -> None:
    total = header.payload_bytes
    if total < 0 or total > max_frame_bytes:
        raise FrameError(f"frame of {total} bytes refused (limit {max_frame_bytes} bytes)")
    for meta in header.tensors:
        if meta.dtype not in DTYPES or (meta.wire_dtype and meta.wire_dtype not in DTYPES):
            raise FrameError(f"tensor {shown(meta.name)}: unknown dtype "
                             f"{shown(meta.dtype)}/{shown(meta.wire_dtype)}")
        if len(meta.shape) > MAX_DIMS or any(d < 0 for d in meta.shape):
            raise FrameError(f"tensor {shown(meta.name)}: invalid shape "
                             f"{shown(list(meta.shape))}")
        numel = extent = 1
        for d in meta.shape:
            numel *= d
            extent *= max(d, 1)
            if extent > _MAX_EXTENT:
                raise FrameError(f"tensor {shown(meta.name)}: invalid shape "
                                 f"{shown(list(meta.shape))}")
        wire = DTYPES[meta.wire_dtype or meta.dtype]
        size = numel * torch.empty(0, dtype=wire).element_size()
        if meta.offset < 0 or meta.offset % ALIGN or meta.offset + size > total:
            raise FrameError(f"tensor {shown(meta.name)}: {size} bytes at offset {meta.offset} "
                             f"do not fit a {total}-byte payload")


def decode_wire(messages: Iterator[bytes],
                max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                pool: BufferPool | None = None) -> Frame:
    """Rebuild a frame from serialized `Chunk` messages (what the gRPC server receives), into a
    buffer from `pool` if given."""
    return assemble(map(parse_chunk, messages), max_frame_bytes, pool)


def assemble(chunks: Iterator[tuple[pb.FrameHeader | None, memoryview | bytes]],
             max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
             pool: BufferPool | None = None) -> Frame:
    """Rebuild a frame from its chunks as (header or None, data), the header first, validating
    everything before and while it is read, into a buffer from `pool` if given."""
    first = next(chunks, None)
    if first is None or first[0] is None:
        raise FrameError("frame has no header")
    header = first[0]
    _check_header(header, max_frame_bytes)
    total = header.payload_bytes
    buffer = pool.take(total) if pool is not None else torch.empty(total, dtype=torch.uint8)
    view = buffer.numpy()
    position = 0
    for _, data in itertools.chain([first], chunks):
        n = len(data)
        if position + n > total:
            raise FrameError(f"frame payload exceeds its declared {total} bytes")
        view[position:position + n] = memoryview(data)
        position += n
    if position != total:
        raise FrameError(f"frame payload truncated: {position} of {total} bytes")
    return _frame(header, buffer)


def _frame(header: pb.FrameHeader, buffer: torch.Tensor) -> Frame:
    tensors: dict[str, torch.Tensor] = {}
    for meta in header.tensors:
        dtype = DTYPES[meta.dtype]
        wire = DTYPES[meta.wire_dtype or meta.dtype]
        numel = 1
        for d in meta.shape:
            numel *= d
        size = numel * torch.empty(0, dtype=wire).element_size()
        raw = buffer[meta.offset:meta.offset + size]
        t = raw.view(wire).reshape(tuple(meta.shape)) if numel else torch.empty(
            tuple(meta.shape), dtype=wire)
        tensors[meta.name] = t.to(dtype) if wire != dtype else t
    try:
        control: Mapping[str, Any] = json.loads(header.control) if header.control else {}
    except (ValueError, RecursionError) as e:
        raise FrameError(f"frame control is not JSON: {e}") from e
    if not isinstance(control, dict):
        raise FrameError("frame control must be a JSON object")
    return Frame(kind=header.kind, tensors=tensors, step=header.step, microbatch=header.microbatch,
                 version=header.version, ring=header.ring, sender=header.sender,
                 control=dict(control), stream=header.stream, sequence=header.sequence,
                 wire_bytes=header.payload_bytes)
