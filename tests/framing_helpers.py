"""The protobuf-object path of framing: frames as `pb.Chunk` objects and back.

Workers never take it (they write and parse serialized messages straight from and into tensor
memory: framing.encode_wire, decode_wire), but tests build and break chunk streams with it as
objects, and bench/transfer.py times it as the path the workers' replaced. It shares the frame
layout and the validation with the workers' path, so what it finds holds for theirs.
"""

from __future__ import annotations

from collections.abc import Iterator

from ravnest.comm.framing import (
    CHUNK_BYTES,
    DEFAULT_MAX_FRAME_BYTES,
    Frame,
    assemble,
    layout,
    payload_pieces,
)
from ravnest.comm.proto import ravnest_pb2 as pb


def encode(frame: Frame, compression: str = "none",
           chunk_bytes: int = CHUNK_BYTES) -> Iterator[pb.Chunk]:
    """Yield the chunks of a frame; the first carries the header."""
    header, views, total = layout(frame, compression)
    first: pb.FrameHeader | None = header
    for pieces in payload_pieces(views, total, chunk_bytes):
        yield pb.Chunk(header=first, data=b"".join(pieces))
        first = None
    if first is not None:
        yield pb.Chunk(header=first)


def decode(chunks: Iterator[pb.Chunk], max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Frame:
    """Rebuild a frame from its chunks, validating everything before and while it is read."""
    return assemble(((c.header if c.HasField("header") else None, c.data) for c in chunks),
                    max_frame_bytes)
