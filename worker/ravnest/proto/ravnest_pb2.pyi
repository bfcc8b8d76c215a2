from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers

DESCRIPTOR: _descriptor.FileDescriptor

class TensorMeta(_message.Message):
    __slots__ = ("dtype", "name", "offset", "shape", "wire_dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    wire_dtype: str
    offset: int
    def __init__(self, name: str | None = ..., dtype: str | None = ..., shape: _Iterable[int] | None = ..., wire_dtype: str | None = ..., offset: int | None = ...) -> None: ...

class FrameHeader(_message.Message):
    __slots__ = ("control", "kind", "microbatch", "payload_bytes", "ring", "sender", "step", "tensors", "version")
    KIND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RING_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONTROL_FIELD_NUMBER: _ClassVar[int]
    kind: str
    step: int
    microbatch: int
    version: int
    ring: str
    sender: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    payload_bytes: int
    control: str
    def __init__(self, kind: str | None = ..., step: int | None = ..., microbatch: int | None = ..., version: int | None = ..., ring: str | None = ..., sender: str | None = ..., tensors: _Iterable[TensorMeta | _Mapping] | None = ..., payload_bytes: int | None = ..., control: str | None = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("data", "header")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: FrameHeader
    data: bytes
    def __init__(self, header: FrameHeader | _Mapping | None = ..., data: bytes | None = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("received_bytes",)
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    received_bytes: int
    def __init__(self, received_bytes: int | None = ...) -> None: ...
