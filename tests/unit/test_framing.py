"""Tensor frames: what is encoded comes back bit for bit (or within the compression's precision),
and a malformed chunk stream only ever raises FrameError, before anything large is allocated."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from framing_helpers import decode, encode
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ravnest.comm.buffers import BufferPool
from ravnest.comm.framing import (
    ALIGN,
    CHUNK_BYTES,
    DEFAULT_MAX_FRAME_BYTES,
    DTYPES,
    Frame,
    FrameError,
    decode_wire,
    encode_one,
    encode_wire,
    parse_chunk,
)
from ravnest.comm.proto import ravnest_pb2 as pb

INT64_MAX = 2**63 - 1


def roundtrip(frame: Frame, compression: str = "none", chunk_bytes: int = CHUNK_BYTES,
              max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Frame:
    return decode(encode(frame, compression, chunk_bytes), max_frame_bytes)


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2**31)), min(info.max, 2**31 - 1), shape, generator=g,
                         dtype=torch.int64).to(dtype)


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert torch.equal(got, want)


def header_chunk(data: bytes = b"", **header: object) -> pb.Chunk:
    header.setdefault("kind", "forward")
    return pb.Chunk(header=pb.FrameHeader(**header), data=data)  # type: ignore[arg-type]


def meta(name: str = "x", dtype: str = "float32", shape: tuple[int, ...] = (4,),
         offset: int = 0, wire_dtype: str = "") -> pb.TensorMeta:
    return pb.TensorMeta(name=name, dtype=dtype, shape=list(shape), offset=offset,
                         wire_dtype=wire_dtype)


# --- round trips

SHAPES = [(), (0,), (3, 0, 2), (7,), (2, 3, 5), (1, 1, 1, 1, 1)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=str)
def test_every_dtype_and_shape_round_trips_exactly(dtype: torch.dtype,
                                                   shape: tuple[int, ...]) -> None:
    tensor = sample(dtype, shape)
    got = roundtrip(Frame("forward", {"x": tensor})).tensors["x"]
    assert_same(got, tensor)


@pytest.mark.parametrize("make", [
    lambda: torch.arange(24.0).reshape(4, 6).t(),
    lambda: torch.arange(40, dtype=torch.int64).reshape(5, 8)[:, ::3],
    lambda: torch.randn(3, 1).expand(3, 5),
    lambda: torch.randn(2, 3, 4).permute(2, 0, 1)[1:],
    lambda: torch.randn(10).flip(0)[2:7],
    lambda: torch.randn(6, 6).diagonal(),
], ids=["transposed", "strided", "expanded", "permuted-slice", "flipped-slice", "diagonal"])
def test_non_contiguous_tensors_round_trip(make) -> None:
    tensor = make()
    got = roundtrip(Frame("forward", {"x": tensor})).tensors["x"]
    assert_same(got, tensor)
    assert got.is_contiguous()


def test_header_fields_control_and_many_tensors_round_trip() -> None:
    tensors = {f"t{i}": sample(dtype, (i + 1, 3), seed=i)
               for i, dtype in enumerate(DTYPES.values())}
    tensors["empty"] = torch.empty(0, 4)
    tensors["scalar"] = torch.tensor(2.5, dtype=torch.float64)
    control = {"epoch": 3, "loss": 0.125, "names": ["a", "ü", ""], "done": True, "none": None,
               "nested": {"deep": [1, [2, {"x": -1e-300}]]}}
    frame = Frame("control", tensors, step=7, microbatch=12, version=3, ring="ring-0-1",
                  sender="node_2", control=control)
    got = roundtrip(frame, chunk_bytes=100)
    assert (got.kind, got.step, got.microbatch, got.version, got.ring, got.sender) == (
        "control", 7, 12, 3, "ring-0-1", "node_2")
    assert got.control == control
    assert list(got.tensors) == list(tensors)
    for name, tensor in tensors.items():
        assert_same(got.tensors[name], tensor)
    assert got.nbytes() == frame.nbytes()


def test_empty_tensors_with_huge_dims_round_trip() -> None:
    tensors = {"a": torch.empty(2**40, 0, 5), "b": torch.empty(0, 2**61, dtype=torch.int64)}
    got = roundtrip(Frame("forward", tensors))
    for name, tensor in tensors.items():
        assert_same(got.tensors[name], tensor)


def test_a_frame_without_tensors_is_one_chunk() -> None:
    chunks = list(encode(Frame("control", control={"epoch_end": 1})))
    assert len(chunks) == 1
    assert chunks[0].HasField("header") and chunks[0].data == b""
    got = decode(iter(chunks))
    assert got.tensors == {} and got.control == {"epoch_end": 1}


def test_empty_control_round_trips_as_empty_dict() -> None:
    assert roundtrip(Frame("forward", {"x": torch.ones(2)})).control == {}


def test_tensors_larger_than_a_chunk_are_streamed_in_chunks() -> None:
    big = torch.randn(CHUNK_BYTES // 4 * 3 + 1001)
    small = torch.arange(10, dtype=torch.int16)
    chunks = list(encode(Frame("forward", {"big": big, "small": small})))
    payload = chunks[0].header.payload_bytes
    assert payload >= big.numel() * 4 + small.numel() * 2
    assert payload % ALIGN == 0
    assert len(chunks) == 4
    assert all(len(c.data) == CHUNK_BYTES for c in chunks[:-1])
    assert sum(len(c.data) for c in chunks) == payload
    assert [c.HasField("header") for c in chunks] == [True, False, False, False]
    got = decode(iter(chunks))
    assert_same(got.tensors["big"], big)
    assert_same(got.tensors["small"], small)


@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 65, 1000])
def test_any_chunk_size_round_trips(chunk_bytes: int) -> None:
    tensors = {"a": torch.randn(5, 3), "b": torch.arange(3, dtype=torch.uint8),
               "c": torch.randn(0), "d": torch.tensor([True, False])}
    got = roundtrip(Frame("backward", tensors), chunk_bytes=chunk_bytes)
    for name, tensor in tensors.items():
        assert_same(got.tensors[name], tensor)


def test_tensor_offsets_are_aligned() -> None:
    tensors = {"a": torch.ones(3, dtype=torch.uint8), "b": torch.ones(5), "c": torch.ones(1)}
    [chunk] = encode(Frame("forward", tensors))
    assert [m.offset for m in chunk.header.tensors] == [0, 64, 128]
    assert chunk.header.payload_bytes == 192


def test_tensors_of_unsupported_dtype_are_refused() -> None:
    with pytest.raises(FrameError, match=r"tensor 'z': dtype torch.complex64 cannot be sent"):
        list(encode(Frame("forward", {"z": torch.zeros(2, dtype=torch.complex64)})))


@pytest.mark.parametrize(("compression", "wire", "rtol"), [
    ("bf16", "bfloat16", 2**-8),
    ("fp16", "float16", 2**-11),
])
def test_compression_halves_float32_and_comes_back_close(compression: str, wire: str,
                                                         rtol: float) -> None:
    tensor = torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 100
    chunks = list(encode(Frame("forward", {"x": tensor}), compression))
    [m] = chunks[0].header.tensors
    assert (m.dtype, m.wire_dtype) == ("float32", wire)
    assert chunks[0].header.payload_bytes == 2048
    got = decode(iter(chunks)).tensors["x"]
    assert got.dtype == torch.float32 and got.shape == tensor.shape
    torch.testing.assert_close(got, tensor, rtol=rtol, atol=0)
    assert not torch.equal(got, tensor)


@pytest.mark.parametrize("compression", ["bf16", "fp16"])
def test_compression_leaves_other_dtypes_exact(compression: str) -> None:
    tensors = {"d": torch.randn(5, dtype=torch.float64) / 3, "i": torch.arange(5),
               "h": torch.randn(4).half(), "b": torch.randn(4).bfloat16()}
    chunks = list(encode(Frame("forward", tensors), compression))
    assert all(m.wire_dtype == "" for m in chunks[0].header.tensors)
    got = decode(iter(chunks))
    for name, tensor in tensors.items():
        assert_same(got.tensors[name], tensor)


@pytest.mark.parametrize("compression", ["bf16", "fp16", "int8"])
def test_a_control_frames_tensors_go_exact_whatever_the_compression(compression: str) -> None:
    """A control frame's tensors are state (a ring's, handed to a node that rejoins): rounded to
    bfloat16 they would leave the rejoined node's weights off the others' (they were, before)."""
    tensor = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    chunks = list(encode(Frame("control", {"p/w": tensor}), compression))
    assert chunks[0].header.tensors[0].wire_dtype == ""
    assert_same(decode(iter(chunks)).tensors["p/w"], tensor)
    forward = list(encode(Frame("forward", {"x": tensor}), compression))
    assert forward[0].header.tensors[0].wire_dtype != ""


@pytest.mark.parametrize("outlier", [65504.5, 70000.0, -1e6, float("inf"), float("-inf")])
def test_fp16_never_clamps_large_values(outlier: float) -> None:
    tensor = torch.randn(100) / 3
    tensor[17] = outlier
    chunks = list(encode(Frame("forward", {"x": tensor}), "fp16"))
    [m] = chunks[0].header.tensors
    assert m.wire_dtype == ""
    assert chunks[0].header.payload_bytes == 448
    assert_same(decode(iter(chunks)).tensors["x"], tensor)


def test_fp16_compresses_values_up_to_its_maximum() -> None:
    tensor = torch.tensor([65504.0, -65504.0, 1.0])
    chunks = list(encode(Frame("forward", {"x": tensor}), "fp16"))
    assert chunks[0].header.tensors[0].wire_dtype == "float16"
    assert_same(decode(iter(chunks)).tensors["x"], tensor)


def test_bf16_keeps_values_beyond_the_fp16_range() -> None:
    tensor = torch.tensor([1e30, -3e38, 70000.0])
    got = roundtrip(Frame("forward", {"x": tensor}), "bf16").tensors["x"]
    torch.testing.assert_close(got, tensor, rtol=2**-8, atol=0)


# --- malformed input


def _raises(chunks: list[pb.Chunk] | Iterator[pb.Chunk], match: str,
            max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
    with pytest.raises(FrameError, match=match):
        decode(iter(chunks), max_frame_bytes)


def test_an_empty_stream_has_no_header() -> None:
    _raises([], r"^frame has no header$")


def test_a_first_chunk_without_header_is_refused() -> None:
    _raises([pb.Chunk(data=b"\x00" * 64)], r"^frame has no header$")


def _header_then_fail(first: pb.Chunk) -> Iterator[pb.Chunk]:
    yield first
    raise AssertionError("the payload was read although the header should have been refused")


def test_a_terabyte_frame_is_refused_before_reading_or_allocating() -> None:
    chunks = _header_then_fail(header_chunk(b"tiny", payload_bytes=1 << 40,
                                            tensors=[meta(shape=(1 << 38,))]))
    _raises(chunks, r"^frame of 1099511627776 bytes refused \(limit 1073741824 bytes\)$")


def test_the_receivers_limit_applies_to_valid_frames() -> None:
    chunks = list(encode(Frame("forward", {"x": torch.ones(1024)})))
    _raises(iter(chunks), r"^frame of 4096 bytes refused \(limit 4095 bytes\)$",
            max_frame_bytes=4095)
    assert decode(iter(chunks), max_frame_bytes=4096).tensors["x"].sum() == 1024


@pytest.mark.parametrize(("header", "match"), [
    ({"payload_bytes": -1}, r"frame of -1 bytes refused"),
    ({"payload_bytes": INT64_MAX}, r"frame of 9223372036854775807 bytes refused"),
    ({"payload_bytes": 64, "tensors": [meta(dtype="float128")]},
     r"tensor 'x': unknown dtype 'float128'/''"),
    ({"payload_bytes": 64, "tensors": [meta(dtype="")]}, r"tensor 'x': unknown dtype ''/''"),
    ({"payload_bytes": 64, "tensors": [meta(wire_dtype="int4")]},
     r"tensor 'x': unknown dtype 'float32'/'int4'"),
    ({"payload_bytes": 64, "tensors": [meta(shape=(4, -1))]},
     r"tensor 'x': invalid shape \[4, -1\]"),
    ({"payload_bytes": 64, "tensors": [meta(shape=(-(2**63),))]}, r"tensor 'x': invalid shape"),
    ({"payload_bytes": 64, "tensors": [meta(shape=(1,) * 17)]}, r"tensor 'x': invalid shape"),
    ({"payload_bytes": 64, "tensors": [meta(offset=-64)]},
     r"tensor 'x': 16 bytes at offset -64 do not fit a 64-byte payload"),
    ({"payload_bytes": 128, "tensors": [meta(offset=8)]},
     r"tensor 'x': 16 bytes at offset 8 do not fit a 128-byte payload"),
    ({"payload_bytes": 64, "tensors": [meta(offset=64)]},
     r"tensor 'x': 16 bytes at offset 64 do not fit a 64-byte payload"),
    ({"payload_bytes": 64, "tensors": [meta(offset=INT64_MAX - 63)]}, r"do not fit"),
    ({"payload_bytes": 64, "tensors": [meta(shape=(17,))]},
     r"tensor 'x': 68 bytes at offset 0 do not fit a 64-byte payload"),
    ({"payload_bytes": 64, "tensors": [meta(shape=(2**62, 2**62))]},
     r"tensor 'x': invalid shape \[4611686018427387904, 4611686018427387904\]"),
    ({"payload_bytes": 0, "tensors": [meta(shape=(2**40, 2**40, 0))]},
     r"tensor 'x': invalid shape \[1099511627776, 1099511627776, 0\]"),
    ({"payload_bytes": 64, "tensors": [meta(dtype="uint8", wire_dtype="float64", shape=(9,))]},
     r"tensor 'x': 72 bytes at offset 0 do not fit a 64-byte payload"),
], ids=["negative-size", "int64-max-size", "unknown-dtype", "empty-dtype", "unknown-wire-dtype",
        "negative-dim", "int64-min-dim", "too-many-dims", "negative-offset", "unaligned-offset",
        "offset-at-end", "offset-overflow", "tensor-past-end", "huge-dims", "huge-empty-dims",
        "wire-past-end"])
def test_bad_headers_are_refused(header: dict[str, object], match: str) -> None:
    payload = header["payload_bytes"]
    data = bytes(payload) if isinstance(payload, int) and 0 <= payload <= 1024 else b""
    _raises(_header_then_fail(header_chunk(data, **header)), match)


def _valid_chunks(chunk_bytes: int = 64) -> list[pb.Chunk]:
    frame = Frame("forward", {"a": torch.randn(20), "b": torch.arange(9)})
    return list(encode(frame, chunk_bytes=chunk_bytes))


def test_a_truncated_payload_is_refused() -> None:
    chunks = _valid_chunks()
    _raises(chunks[:-1], r"^frame payload truncated: 192 of 256 bytes$")


def test_a_short_last_chunk_is_refused() -> None:
    chunks = _valid_chunks()
    chunks[-1] = pb.Chunk(data=chunks[-1].data[:-1])
    _raises(chunks, r"^frame payload truncated: 255 of 256 bytes$")


def test_a_header_without_the_payload_is_refused() -> None:
    _raises([header_chunk(payload_bytes=64, tensors=[meta()])],
            r"^frame payload truncated: 0 of 64 bytes$")


def test_excess_payload_is_refused() -> None:
    chunks = _valid_chunks()
    _raises([*chunks, pb.Chunk(data=b"\x00")], r"^frame payload exceeds its declared 256 bytes$")


def test_excess_payload_in_the_first_chunk_is_refused() -> None:
    _raises([header_chunk(bytes(65), payload_bytes=64, tensors=[meta()])],
            r"^frame payload exceeds its declared 64 bytes$")


@pytest.mark.parametrize(("control", "match"), [
    ("{not json", r"^frame control is not JSON"),
    ("{'single': 1}", r"^frame control is not JSON"),
    ("1" * 5000, r"^frame control is not JSON"),
    ("[" * 100_000, r"^frame control is not JSON"),
    ("[1, 2]", r"^frame control must be a JSON object$"),
    ('"text"', r"^frame control must be a JSON object$"),
    ("null", r"^frame control must be a JSON object$"),
], ids=["broken", "python-literal", "huge-number", "deep-nesting", "list", "string", "null"])
def test_control_that_is_not_a_json_object_is_refused(control: str, match: str) -> None:
    _raises([header_chunk(control=control)], match)


# --- fuzzing: random and mutated chunk streams give a Frame or a FrameError, nothing else

FUZZ_LIMIT = 1 << 16
NAMES = st.sampled_from([*DTYPES, "", "float128", "complex64"])
INT64 = st.integers(-(2**63), INT64_MAX)
SMALL = st.integers(-2, 200)
METAS = st.builds(
    pb.TensorMeta, name=st.text(max_size=3), dtype=NAMES, wire_dtype=NAMES,
    shape=st.lists(SMALL | INT64, max_size=18),
    offset=st.sampled_from([0, 64, 128]) | SMALL | INT64,
)
CONTROLS = st.sampled_from(["", "{}", '{"a": [1, 2]}', "[]", "{", "[" * 5000, "1e999", "NaN"]) \
    | st.text(max_size=10)
HEADERS = st.builds(
    pb.FrameHeader, kind=st.text(max_size=8), step=INT64, microbatch=INT64, version=INT64,
    ring=st.text(max_size=4), sender=st.text(max_size=4), tensors=st.lists(METAS, max_size=3),
    payload_bytes=st.sampled_from([0, 64, 128, 256]) | st.integers(-8, FUZZ_LIMIT * 2) | INT64,
    control=CONTROLS,
)
CHUNKS = st.builds(pb.Chunk, data=st.binary(max_size=300)) | st.builds(
    pb.Chunk, header=HEADERS, data=st.binary(max_size=300))


def _decoded_or_frame_error(chunks: list[pb.Chunk]) -> None:
    try:
        frame = decode(iter(chunks), FUZZ_LIMIT)
    except FrameError:
        return
    assert isinstance(frame, Frame)
    shapes = {m.name: list(m.shape) for m in chunks[0].header.tensors}
    assert {name: list(t.shape) for name, t in frame.tensors.items()} == shapes


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(CHUNKS, max_size=4))
def test_random_chunk_streams_give_a_frame_or_a_frame_error(chunks: list[pb.Chunk]) -> None:
    _decoded_or_frame_error(chunks)


FRAMES = st.builds(
    lambda specs, control: Frame(
        "forward", {f"t{i}": sample(dtype, tuple(shape), seed=i)
                    for i, (dtype, shape) in enumerate(specs)}, control=control),
    st.lists(st.tuples(st.sampled_from(list(DTYPES.values())),
                       st.lists(st.integers(0, 5), max_size=3)), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers() | st.text(max_size=3), max_size=2),
)
MUTATIONS = st.lists(st.tuples(
    st.sampled_from(["drop", "duplicate", "cut", "extend", "unheader", "size", "shape", "offset",
                     "dtype", "control"]),
    st.integers(0, 100), st.integers(-300, 300), NAMES,
), max_size=3)


def _mutate(chunks: list[pb.Chunk], action: str, where: int, amount: int,
            dtype: str) -> list[pb.Chunk]:
    if not chunks:
        return chunks
    i = where % len(chunks)
    out = [pb.Chunk.FromString(c.SerializeToString()) for c in chunks]
    header = out[0].header
    metas = header.tensors
    if action == "drop":
        del out[i]
    elif action == "duplicate":
        out.insert(i, out[i])
    elif action == "cut":
        out[i].data = out[i].data[:max(0, len(out[i].data) - abs(amount))]
    elif action == "extend":
        out[i].data += bytes(abs(amount))
    elif action == "unheader":
        out[0].ClearField("header")
    elif action == "size":
        header.payload_bytes += amount
    elif action == "shape" and metas:
        m = metas[i % len(metas)]
        if amount % 2 or not m.shape:
            m.shape.append(amount)
        else:
            m.shape[amount % len(m.shape)] = amount
    elif action == "offset" and metas:
        metas[i % len(metas)].offset += amount
    elif action == "dtype" and metas:
        m = metas[i % len(metas)]
        if amount % 2:
            m.wire_dtype = dtype
        else:
            m.dtype = dtype
    elif action == "control":
        header.control = header.control[:abs(amount) % (len(header.control) + 1)]
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(FRAMES, st.integers(1, 200), MUTATIONS)
def test_mutated_encodings_give_a_frame_or_a_frame_error(
        frame: Frame, chunk_bytes: int, mutations: list[tuple[str, int, int, str]]) -> None:
    chunks = list(encode(frame, chunk_bytes=chunk_bytes))
    for mutation in mutations:
        chunks = _mutate(chunks, *mutation)
    if not mutations:
        got = decode(iter(chunks))
        assert json.dumps(got.control) == json.dumps(frame.control)
        for name, tensor in frame.tensors.items():
            assert_same(got.tensors[name], tensor)
        return
    _decoded_or_frame_error(chunks)


# --- the wire form: serialized Chunk messages, as gRPC carries them ---------------------------

def _assert_frames_equal(got: Frame, want: Frame) -> None:
    assert json.dumps(got.control) == json.dumps(want.control)
    assert got.tensors.keys() == want.tensors.keys()
    for name, tensor in want.tensors.items():
        assert_same(got.tensors[name], tensor)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(FRAMES, st.integers(1, 200))
def test_wire_messages_are_the_protobuf_encoding_of_the_chunks(frame: Frame,
                                                               chunk_bytes: int) -> None:
    messages = encode_wire(frame, chunk_bytes=chunk_bytes)
    # protobuf reads our hand-written messages ...
    _assert_frames_equal(decode(iter([pb.Chunk.FromString(m) for m in messages])), frame)
    # ... we read them back, and we read what protobuf itself serializes (any other client)
    _assert_frames_equal(decode_wire(iter(messages)), frame)
    protobuf = [c.SerializeToString() for c in encode(frame, chunk_bytes=chunk_bytes)]
    _assert_frames_equal(decode_wire(iter(protobuf)), frame)


def test_wire_messages_carry_at_most_one_chunk_of_payload() -> None:
    frame = Frame("forward", {"x": torch.arange(3 * CHUNK_BYTES // 4 + 5, dtype=torch.float32)})
    messages = encode_wire(frame)
    assert pb.Chunk.FromString(messages[0]).header.payload_bytes == frame.nbytes() + 44
    assert [len(pb.Chunk.FromString(m).data) for m in messages[1:]] == [
        CHUNK_BYTES, CHUNK_BYTES, CHUNK_BYTES, 64]
    assert max(len(m) for m in messages) < CHUNK_BYTES + 16


def test_wire_messages_are_a_snapshot_of_the_tensors() -> None:
    x = torch.ones(1000)
    messages = encode_wire(Frame("reduce", {"x": x}))
    x.zero_()
    assert torch.equal(decode_wire(iter(messages)).tensors["x"], torch.ones(1000))


@pytest.mark.parametrize("messages, match", [
    ([], "no header"),
    ([b"\x12\x03abc"], "no header"),
    ([b"\xff\xff\xff"], "not a Chunk"),
    ([pb.Chunk(header=pb.FrameHeader(kind="forward", payload_bytes=4)).SerializeToString(),
      b"\x12\x09abc"], "not a Chunk"),
])
def test_malformed_wire_messages_are_refused(messages: list[bytes], match: str) -> None:
    with pytest.raises(FrameError, match=match):
        decode_wire(iter(messages))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(FRAMES, st.integers(1, 200), st.lists(st.tuples(st.integers(0, 50), st.integers(0, 400),
                                                       st.binary(max_size=4)), max_size=3))
def test_mutated_wire_bytes_give_a_frame_or_a_frame_error(
        frame: Frame, chunk_bytes: int, edits: list[tuple[int, int, bytes]]) -> None:
    messages = encode_wire(frame, chunk_bytes=chunk_bytes)
    for which, at, replacement in edits:
        i = which % len(messages)
        m = messages[i]
        messages[i] = m[:at % (len(m) + 1)] + replacement + m[at % (len(m) + 1) + len(replacement):]
    try:
        got = decode_wire(iter(messages), FUZZ_LIMIT)
    except FrameError:
        return
    assert isinstance(got, Frame)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(FRAMES, st.sampled_from(["none", "bf16"]))
def test_one_message_frames_are_one_protobuf_chunk(frame: Frame, compression: str) -> None:
    """`encode_one` (what a frame of up to one chunk goes as, on the unary call) is the Chunk
    protobuf would write with both fields, and reads back like the chunked form."""
    message = encode_one(frame, compression)
    chunked = encode_wire(frame, compression)
    parsed = pb.Chunk.FromString(message)
    assert parsed.header == pb.Chunk.FromString(chunked[0]).header
    assert parsed.data == b"".join(pb.Chunk.FromString(m).data for m in chunked[1:])
    got, want = decode_wire(iter([message])), decode_wire(iter(chunked))
    assert got.control == want.control and got.tensors.keys() == want.tensors.keys()
    for name, tensor in want.tensors.items():
        assert_same(got.tensors[name], tensor)


def test_a_one_message_frame_is_read_without_copying_its_payload() -> None:
    x = torch.arange(1000, dtype=torch.float32)
    message = encode_one(Frame("forward", {"x": x}, microbatch=3))
    header, data = parse_chunk(message)
    assert header is not None and header.microbatch == 3
    assert isinstance(data, memoryview) and data.obj is message  # a slice of the message
    assert bytes(data) == x.numpy().tobytes() + bytes(len(data) - 4000)  # aligned: padded
    # a header that is not a FrameHeader, with valid data after it, is a frame error
    data_field = message[len(pb.Chunk(header=header).SerializeToString()):]
    assert data_field[:1] == b"\x12"
    broken = b"\x0a\x03\xff\xff\xff" + data_field
    with pytest.raises(FrameError, match="not a FrameHeader"):
        decode_wire(iter([broken]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(FRAMES, st.lists(st.tuples(st.integers(0, 400), st.binary(max_size=4)), max_size=3))
def test_mutated_one_message_bytes_give_a_frame_or_a_frame_error(
        frame: Frame, edits: list[tuple[int, bytes]]) -> None:
    m = encode_one(frame)
    for at, replacement in edits:
        at %= len(m) + 1
        m = m[:at] + replacement + m[at + len(replacement):]
    try:
        got = decode_wire(iter([m]), FUZZ_LIMIT)
    except FrameError:
        return
    assert isinstance(got, Frame)


# Receive buffers reused (BufferPool): a large frame's buffer is handed out again only once
# nothing refers to it, so a frame still held is never overwritten by a later one.

MIB = 1 << 20


def _big(value: float, numel: int = MIB) -> Frame:
    return Frame("activations", {"x": torch.full((numel,), value), "y": torch.arange(7)})


def _received(pool: BufferPool, value: float, numel: int = MIB) -> Frame:
    return decode_wire(iter(encode_wire(_big(value, numel))), pool=pool)


def test_a_dropped_frames_buffer_receives_the_next_frame_of_its_size() -> None:
    pool = BufferPool(max_bytes=64 * MIB, min_bytes=MIB)
    assert pool.enabled
    first = _received(pool, 1.0)
    where = first.tensors["x"].data_ptr()
    del first
    second = _received(pool, 2.0)
    assert pool.reused == 1 and second.tensors["x"].data_ptr() == where
    assert torch.equal(second.tensors["x"], torch.full((MIB,), 2.0))
    assert torch.equal(second.tensors["y"], torch.arange(7))


@pytest.mark.parametrize("hold", ["tensor", "view", "numpy", "autograd"])
def test_a_frame_still_referenced_is_never_overwritten(hold: str) -> None:
    pool = BufferPool(max_bytes=64 * MIB, min_bytes=MIB)
    first = _received(pool, 1.0)
    x = first.tensors["x"]
    kept: object
    if hold == "tensor":
        kept = x
    elif hold == "view":
        kept = x[5:9].view(torch.int32)
    elif hold == "numpy":
        kept = x.numpy()[3:]
    else:  # what a stage keeps for its backward pass: its input, saved by autograd
        leaf = torch.ones(MIB, requires_grad=True)
        kept = (leaf * x).sum()
    del first, x
    later = [_received(pool, float(v)) for v in (2, 3, 4)]
    assert pool.reused == 0
    if hold == "autograd":
        kept.backward()  # type: ignore[attr-defined]
        assert torch.equal(leaf.grad, torch.full((MIB,), 1.0))
    elif hold == "numpy":
        assert (kept == 1.0).all()  # type: ignore[attr-defined]
    else:
        assert torch.equal(kept.view(torch.float32) if hold == "view" else kept,  # type: ignore
                           torch.full((4 if hold == "view" else MIB,), 1.0))
    assert [f.tensors["x"][0].item() for f in later] == [2.0, 3.0, 4.0]
    del kept, later
    assert torch.equal(_received(pool, 5.0).tensors["x"], torch.full((MIB,), 5.0))
    assert pool.reused == 1


def test_small_and_compressed_frames_and_other_sizes() -> None:
    pool = BufferPool(max_bytes=64 * MIB, min_bytes=MIB)
    for value in (1.0, 2.0):  # under min_bytes: plain allocations, never tracked
        assert _received(pool, value, numel=1000).tensors["x"][0] == value
    assert pool.held_bytes == 0
    del_me = _received(pool, 1.0)
    del del_me
    other = _received(pool, 3.0, numel=MIB + 16)  # another size: its own buffer
    assert pool.reused == 0 and other.tensors["x"][-1] == 3.0
    # bf16 on the wire: the frame holds converted copies, so its buffer is free at once
    wire = encode_wire(_big(4.0, numel=2 * MIB), compression="bf16")
    first = decode_wire(iter(wire), pool=pool)
    second = decode_wire(iter(wire), pool=pool)
    assert pool.reused == 1
    assert torch.equal(first.tensors["x"], second.tensors["x"])


def test_the_pool_tracks_at_most_max_bytes() -> None:
    pool = BufferPool(max_bytes=12 * MIB, min_bytes=MIB)
    held = [_received(pool, float(v)) for v in range(5)]  # 4 MiB each, all in use
    assert pool.held_bytes <= 12 * MIB
    assert [f.tensors["x"][-1].item() for f in held] == [0.0, 1.0, 2.0, 3.0, 4.0]
    del held
    assert _received(pool, 9.0).tensors["x"][0] == 9.0
    assert pool.reused == 1 and pool.held_bytes <= 12 * MIB


def test_concurrent_receivers_never_share_a_buffer() -> None:
    """Server threads decode at once, each pausing between chunks as a network read does: every
    frame arrives intact while the buffers go round between them."""
    pool = BufferPool(max_bytes=64 * MIB, min_bytes=MIB)
    numel = MIB // 4
    wires = {v: encode_wire(_big(float(v), numel), chunk_bytes=64 << 10) for v in range(4)}
    start = threading.Barrier(len(wires))
    bad: list[str] = []

    def network(messages: list[bytes]) -> Iterator[bytes]:
        for message in messages:
            time.sleep(0)
            yield message

    def receive(v: int) -> None:
        want = torch.full((numel,), float(v))
        start.wait()
        for i in range(30):  # each frame checked, then dropped: few buffers, reused all the time
            if not torch.equal(decode_wire(network(wires[v]), pool=pool).tensors["x"], want):
                bad.append(f"receiver {v}, frame {i}")

    threads = [threading.Thread(target=receive, args=(v,)) for v in wires]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad
    assert pool.reused > 0 and pool.held_bytes <= 8 * MIB


def test_a_free_buffer_behind_one_in_use_is_the_one_let_go() -> None:
    """Past `max_bytes` the pool lets a free buffer go before one still in use, wherever it is."""
    pool = BufferPool(max_bytes=10 * MIB, min_bytes=MIB)
    held = _received(pool, 1.0)  # 4 MiB, in use
    dropped = _received(pool, 2.0, numel=MIB + 16)  # 4 MiB and a bit, dropped
    del dropped
    other = _received(pool, 3.0, numel=MIB // 2 + 16)  # over the limit: the dropped one goes
    assert pool.reused == 0 and pool.held_bytes <= 10 * MIB
    assert held.tensors["x"][0] == 1.0 and other.tensors["x"][0] == 3.0


def test_a_buffer_given_back_is_handed_out_again_while_still_referenced() -> None:
    """What the data plane does with a ring piece: its reader knows when it is done with it."""
    pool = BufferPool(max_bytes=8 * MIB, min_bytes=1)
    piece = pool.take(4096).view(torch.float32)
    assert pool.take(4096).data_ptr() != piece.data_ptr()  # still referenced: not handed out
    pool.give_back(piece)
    again = pool.take(4096)
    assert again.data_ptr() == piece.data_ptr() and pool.reused == 1
    assert pool.take(4096).data_ptr() != again.data_ptr()  # handed out: not given back any more


def test_a_buffer_given_back_beyond_the_limit_is_not_kept() -> None:
    pool = BufferPool(max_bytes=2 * MIB, min_bytes=1)
    pieces = [pool.take(MIB) for _ in range(3)]  # the third one makes the first let go
    assert pool.held_bytes == 2 * MIB
    for piece in pieces:
        pool.give_back(piece)
    assert pool.held_bytes == 2 * MIB
    assert {pool.take(MIB).data_ptr() for _ in range(2)} == {p.data_ptr() for p in pieces[1:]}
    pool.give_back(torch.empty(3 * MIB, dtype=torch.uint8))  # larger than the pool: ignored
    assert pool.held_bytes == 2 * MIB
