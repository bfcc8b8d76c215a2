"""Fuzzing every gRPC handler of a real worker server (a subprocess running `transport.Server`
with a real `Inbox`, see fuzz_server.py) over real gRPC on 127.0.0.1.

Peer.Send and Peer.SendOne get 10,000 seeded cases (every fourth, its messages joined into one,
on SendOne): valid frames and random bytes, random headers, and mutations of valid encodings (bit
flips, truncation, dropped and repeated messages, changed header fields, oversized declared shapes
and sizes). Each answer is compared with what the frame decoder says about the same bytes on this
side: a valid frame is acknowledged with its size, anything else gets
INVALID_ARGUMENT with the decoder's message, never another status. The health service and unknown
methods get garbage too. Throughout, the server process stays alive, keeps serving, its memory
stays bounded, and frames declared larger than its limit are refused from their header, before
their bytes are allocated (the process's peak virtual size does not move).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch
from fuzz_server import digest
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2

from ravnest.comm.framing import (
    CHUNK_BYTES,
    DEFAULT_MAX_FRAME_BYTES,
    DTYPES,
    Frame,
    FrameError,
    decode_wire,
    encode_wire,
)
from ravnest.comm.proto import ravnest_pb2 as pb
from ravnest.comm.transport import SERVICE, Credentials
from ravnest.errors import shown

HERE = Path(__file__).resolve().parent
CREDS = Credentials(token="fuzz-token", fingerprint="plan-fuzz")
SEED = 20240607
CASES = 10_000
LIMIT = 1 << 20
"""The fuzzed server's frame limit: small enough that random sizes often cross it."""
TIMEOUT = 30.0
KINDS = ("forward", "backward", "eval", "control", "reduce", "gather")
MiB = 1 << 20


class FuzzServer:
    """The server subprocess, its address and its memory figures."""

    def __init__(self, limit: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "fuzz_server.py"), CREDS.token, CREDS.fingerprint,
             str(limit)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.strip().isdigit(), f"fuzz server did not start: {line!r}"
        self.channel = grpc.insecure_channel(f"127.0.0.1:{int(line)}")
        self.send = self.channel.stream_unary(f"/{SERVICE}/Send", request_serializer=None,
                                              response_deserializer=pb.Ack.FromString)
        self.send_one = self.channel.unary_unary(f"/{SERVICE}/SendOne", request_serializer=None,
                                                 response_deserializer=pb.Ack.FromString)

    def memory(self) -> dict[str, int]:
        """VmRSS, VmHWM (peak RSS), VmSize and VmPeak (peak virtual size) in bytes."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM", "VmSize",
                                                                "VmPeak")}

    def call(self, messages: list[bytes] | Iterator[bytes],
             metadata: tuple[tuple[str, str], ...] = CREDS.metadata()) -> tuple[str, object]:
        """Send the messages as one Peer.Send call: ("OK", acked bytes) or (status, details)."""
        try:
            ack = self.send(iter(messages), metadata=metadata, timeout=TIMEOUT)
        except grpc.RpcError as e:
            return e.code().name, e.details()
        return "OK", ack.received_bytes

    def call_one(self, message: bytes) -> tuple[str, object]:
        """Send one message as a Peer.SendOne call (a frame that fits one Chunk)."""
        try:
            ack = self.send_one(message, metadata=CREDS.metadata(), timeout=TIMEOUT)
        except grpc.RpcError as e:
            return e.code().name, e.details()
        return "OK", ack.received_bytes

    def alive(self) -> bool:
        return self.proc.poll() is None

    def finish(self) -> dict[str, object]:
        """Close stdin; the server stops and reports what was delivered to its inbox."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.channel.close()
        self.proc.stdin.close()
        out = self.proc.stdout.read()
        assert self.proc.wait(timeout=TIMEOUT) == 0
        return dict(json.loads(out.strip().splitlines()[-1]))

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def fuzz_server(request: pytest.FixtureRequest) -> Iterator[FuzzServer]:
    server = FuzzServer(getattr(request, "param", LIMIT))
    try:
        yield server
    finally:
        server.kill()


# --- cases


def _tensor(rng: random.Random) -> torch.Tensor:
    dtype = rng.choice(list(DTYPES.values()))
    shape = tuple(rng.randint(0, 4) for _ in range(rng.randint(0, 3)))
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 1000).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


def valid_frame(rng: random.Random) -> Frame:
    kind = rng.choice(KINDS)
    tensors = {rng.choice(["x", "act", "grad", "p.0", "ü", ""]) + str(i): _tensor(rng)
               for i in range(rng.randint(0, 3))}
    control = rng.choice([{}, {"epoch": rng.randint(0, 9)}, {"loss": rng.random(), "done": True}])
    return Frame(kind, tensors, step=rng.randint(0, 50), microbatch=rng.randint(0, 50),
                 version=rng.randint(0, 3), ring=rng.choice(["", "ring-0", "ring-1-2"]),
                 sender=f"node_{rng.randint(0, 5)}", control=control)


def valid_messages(rng: random.Random) -> list[bytes]:
    return encode_wire(valid_frame(rng), rng.choice(["none", "none", "bf16", "fp16"]),
                       chunk_bytes=rng.choice([7, 64, 100, 1000, CHUNK_BYTES]))


HUGE = [LIMIT + 1, LIMIT + 64, 1 << 31, 1 << 40, 2**62, 2**63 - 1, -1, -(2**63)]
ODD_NAMES = ["", "\x00", "x" * 3000, "y" * 20000, "naïve\u202e", "a\nb", "\udc80".encode(
    "utf-8", "surrogatepass").decode("latin-1")]


def _int(rng: random.Random) -> int:
    return rng.choice([rng.randint(-5, 300), rng.choice(HUGE), rng.randint(-(2**63), 2**63 - 1)])


def _edit_header(rng: random.Random, messages: list[bytes]) -> list[bytes]:
    """Change one field of the header (the first message) and serialize it again."""
    try:
        chunk = pb.Chunk.FromString(messages[0])
    except DecodeError:
        return messages
    h = chunk.header
    field = rng.choice(["payload", "payload", "shape", "shape", "offset", "dtype", "wire_dtype",
                        "kind", "control", "name", "add_tensor", "drop_tensors", "ints"])
    metas = list(h.tensors)
    m = rng.choice(metas) if metas else None
    if field == "payload":
        h.payload_bytes = rng.choice([h.payload_bytes + rng.randint(-130, 130), _int(rng)])
    elif field == "shape" and m is not None:
        if m.shape and rng.random() < 0.5:
            m.shape[rng.randrange(len(m.shape))] = _int(rng)
        else:
            m.shape.append(rng.choice([0, 1, 2, 1 << 20, 1 << 40, -1]))
    elif field == "offset" and m is not None:
        m.offset = rng.choice([m.offset + rng.randint(-70, 70), _int(rng), 64 * rng.randint(0, 9)])
    elif field in ("dtype", "wire_dtype") and m is not None:
        setattr(m, field, rng.choice([*DTYPES, "", "float128", "complex64", "Float32"]))
    elif field == "kind":
        h.kind = rng.choice([*KINDS, "", "gossip", "FORWARD", "forward\x00", "k" * 20000])
    elif field == "control":
        h.control = rng.choice(["", "{}", "[1]", "null", "{", "[" * 20000, "1" * 5000, "NaN",
                                '{"a": 1e999}', h.control[: rng.randint(0, len(h.control))]])
    elif field == "name" and m is not None:
        m.name = rng.choice(ODD_NAMES)
    elif field == "add_tensor":
        h.tensors.add(name=rng.choice(ODD_NAMES), dtype=rng.choice(list(DTYPES)),
                      shape=[rng.choice([0, 1, 3, 1 << 30, 1 << 62]) for _ in range(rng.randint(
                          0, 18))], offset=rng.choice([0, 64, _int(rng)]))
    elif field == "drop_tensors":
        del h.tensors[:]
    elif field == "ints":
        setattr(h, rng.choice(["step", "microbatch", "version"]), _int(rng))
    return [chunk.SerializeToString(), *messages[1:]]


def _edit_bytes(rng: random.Random, messages: list[bytes]) -> list[bytes]:
    """Flip, overwrite, cut, drop, repeat or add bytes and messages."""
    out = list(messages)
    action = rng.choice(["flip", "flip", "overwrite", "cut", "drop", "repeat", "swap", "append",
                         "insert_byte", "delete_byte", "empty_message"])
    i = rng.randrange(len(out)) if out else 0
    if not out:
        out.append(bytes(rng.randrange(256) for _ in range(rng.randint(0, 20))))
    elif action == "flip" and out[i]:
        m = bytearray(out[i])
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(m))
            m[at] ^= 1 << rng.randrange(8)
        out[i] = bytes(m)
    elif action == "overwrite" and out[i]:
        at = rng.randrange(len(out[i]))
        junk = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        out[i] = out[i][:at] + junk + out[i][at + len(junk):]
    elif action == "cut":
        out[i] = out[i][: rng.randint(0, len(out[i]))]
    elif action == "drop":
        del out[i]
    elif action == "repeat":
        out.insert(i, out[i])
    elif action == "swap" and len(out) > 1:
        j = rng.randrange(len(out))
        out[i], out[j] = out[j], out[i]
    elif action == "append":
        out.append(b"\x12" + bytes([rng.randint(0, 127)]) + bytes(rng.randint(0, 130)))
    elif action == "insert_byte":
        at = rng.randint(0, len(out[i]))
        out[i] = out[i][:at] + bytes([rng.randrange(256)]) + out[i][at:]
    elif action == "delete_byte" and out[i]:
        at = rng.randrange(len(out[i]))
        out[i] = out[i][:at] + out[i][at + 1:]
    elif action == "empty_message":
        out.insert(i, b"")
    return out


def _random_header(rng: random.Random) -> list[bytes]:
    header = pb.FrameHeader(
        kind=rng.choice([*KINDS, "x"]), step=_int(rng), payload_bytes=rng.choice(
            [0, 64, 128, rng.randint(0, 4096), _int(rng)]),
        control=rng.choice(["", "{}", "{", "[]"]),
        tensors=[pb.TensorMeta(name=rng.choice([*ODD_NAMES[:2], "t"]),
                               dtype=rng.choice([*DTYPES, "?"]),
                               wire_dtype=rng.choice(["", "", *DTYPES]),
                               shape=[rng.choice([0, 1, 2, 16, _int(rng)])
                                      for _ in range(rng.randint(0, 3))],
                               offset=rng.choice([0, 64, _int(rng)]))
                 for _ in range(rng.randint(0, 3))])
    first = pb.Chunk(header=header, data=bytes(rng.randint(0, 200))).SerializeToString()
    return [first, *(pb.Chunk(data=bytes(rng.randint(0, 300))).SerializeToString()
                     for _ in range(rng.randint(0, 3)))]


def _oversized(rng: random.Random) -> list[bytes]:
    """A header declaring more than the limit (by size or by a tensor's shape), then some data."""
    size = rng.choice(HUGE[:6])
    metas = [pb.TensorMeta(name="x", dtype="float32", shape=[max(1, size // 4)])]
    header = pb.FrameHeader(kind="forward", payload_bytes=size, tensors=metas)
    return [pb.Chunk(header=header).SerializeToString(),
            *[pb.Chunk(data=bytes(1000)).SerializeToString()] * rng.randint(0, 3)]


CATEGORIES: dict[str, Callable[[random.Random], list[bytes]]] = {
    "valid": valid_messages,
    "header-edit": lambda rng: _edit_header(rng, valid_messages(rng)),
    "byte-edit": lambda rng: _edit_bytes(rng, valid_messages(rng)),
    "edits": lambda rng: _edit_bytes(rng, _edit_header(rng, _edit_header(rng, valid_messages(
        rng)))),
    "random-header": _random_header,
    "random-bytes": lambda rng: [bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
                                 for _ in range(rng.randint(0, 4))],
    "oversized": _oversized,
}
WEIGHTS = [15, 25, 25, 15, 10, 5, 5]


def expected(messages: list[bytes], limit: int) -> tuple[str, object]:
    """What the server must answer, from decoding the same bytes here."""
    try:
        frame = decode_wire(iter(messages), limit)
    except FrameError as e:
        return "INVALID_ARGUMENT", str(e)
    if frame.kind not in KINDS:
        return "INVALID_ARGUMENT", f"frame rejected: unknown frame kind {shown(frame.kind)}"
    return "OK", frame.wire_bytes


def check_serves_a_valid_frame(server: FuzzServer) -> Frame:
    frame = Frame("forward", {"x": torch.arange(12.0).reshape(3, 4), "i": torch.arange(5)},
                  step=7, sender="node_0", control={"after": "fuzzing"})
    assert server.call(encode_wire(frame)) == ("OK", 128)
    return frame


# --- Peer.Send


def test_fuzzed_frames_get_invalid_argument_and_the_worker_keeps_serving(
        fuzz_server: FuzzServer) -> None:
    rng = random.Random(SEED)
    names = list(CATEGORIES)
    outcomes: Counter[str] = Counter()
    by_category: Counter[str] = Counter()
    accepted: Counter[str] = Counter()
    wrong: list[str] = []
    start = time.monotonic()
    warm = fuzz_server.memory()
    for case in range(CASES):
        if case == 1000:
            warm = fuzz_server.memory()
        category = rng.choices(names, WEIGHTS)[0]
        messages = CATEGORIES[category](rng)
        if case % 4 == 3:  # every fourth case as one message on the unary Peer.SendOne
            messages = [b"".join(messages)]
            want = expected(messages, LIMIT)
            got = fuzz_server.call_one(messages[0])
        else:
            want = expected(messages, LIMIT)
            got = fuzz_server.call(messages)
        by_category[category] += 1
        outcomes[got[0]] += 1
        if got != want:
            wrong.append(f"case {case} ({category}): got {got!r:.300}, want {want!r:.300}")
        elif got[0] == "OK":
            accepted[decode_wire(iter(messages), LIMIT).kind] += 1
        if case % 2000 == 1999:
            assert fuzz_server.alive(), f"the server died at case {case}"
    after = fuzz_server.memory()
    last = check_serves_a_valid_frame(fuzz_server)
    elapsed = time.monotonic() - start
    print(f"\nPeer.Send fuzz: {CASES} cases (seed {SEED}) in {elapsed:.1f}s; by category "
          f"{dict(by_category)}; answers {dict(outcomes)}")
    print(f"server RSS after 1000 cases {warm['VmRSS'] / MiB:.1f} MiB, after {CASES} "
          f"{after['VmRSS'] / MiB:.1f} MiB (peak {after['VmHWM'] / MiB:.1f} MiB)")
    assert not wrong, f"{len(wrong)} answers differ from the decoder:\n" + "\n".join(wrong[:20])
    assert set(outcomes) == {"OK", "INVALID_ARGUMENT"}
    assert outcomes["OK"] > CASES // 10 and outcomes["INVALID_ARGUMENT"] > CASES // 2
    assert after["VmRSS"] - warm["VmRSS"] < 64 * MiB
    assert fuzz_server.alive()
    report = fuzz_server.finish()
    accepted["forward"] += 1
    assert report == {"delivered": dict(accepted), "last": digest(last)}


@pytest.mark.parametrize("fuzz_server", [DEFAULT_MAX_FRAME_BYTES], indirect=True)
def test_oversized_frames_are_refused_before_their_bytes_are_allocated(
        fuzz_server: FuzzServer) -> None:
    """With the worker's default limit (1 GiB): frames declared larger are refused from the
    header and the server's peak virtual size stays put; a frame declared at the limit does
    allocate its buffer (shown by the same measure), then fails as truncated."""
    calls = [fuzz_server.send.future(iter(valid_messages(random.Random(i))),
                                     metadata=CREDS.metadata(), timeout=TIMEOUT)
             for i in range(64)]
    for call in calls:
        call.result()
    before = fuzz_server.memory()

    def header(size: int, shape: list[int]) -> bytes:
        return pb.Chunk(header=pb.FrameHeader(kind="forward", payload_bytes=size, tensors=[
            pb.TensorMeta(name="x", dtype="uint8", shape=shape)])).SerializeToString()

    def flood(size: int, shape: list[int]) -> Iterator[bytes]:
        yield header(size, shape)
        for _ in range(16):
            yield pb.Chunk(data=bytes(MiB)).SerializeToString()

    limit = DEFAULT_MAX_FRAME_BYTES
    for size in (limit + 64, 1 << 33, 1 << 40, 2**63 - 1):
        for shape in ([size], [1]):
            assert fuzz_server.call(flood(size, shape)) == (
                "INVALID_ARGUMENT", f"frame of {size} bytes refused (limit {limit} bytes)")
    for shape in ([1 << 40], [1 << 31, 1 << 31], [2**62, 4]):
        got = fuzz_server.call(flood(limit, shape))
        assert got[0] == "INVALID_ARGUMENT" and "tensor 'x'" in str(got[1]), got
    refused = fuzz_server.memory()
    assert fuzz_server.call([header(limit, [limit])]) == (
        "INVALID_ARGUMENT", f"frame payload truncated: 0 of {limit} bytes")
    allocated = fuzz_server.memory()
    print(f"\nserver VmPeak {before['VmPeak'] / MiB:.0f} MiB; after 11 oversized frames "
          f"{refused['VmPeak'] / MiB:.0f} MiB; after one frame declared at the 1 GiB limit "
          f"{allocated['VmPeak'] / MiB:.0f} MiB; RSS {before['VmRSS'] / MiB:.0f} -> "
          f"{allocated['VmRSS'] / MiB:.0f} MiB")
    assert refused["VmPeak"] - before["VmPeak"] < 256 * MiB
    assert allocated["VmPeak"] >= refused["VmSize"] + limit - 64 * MiB
    assert allocated["VmRSS"] - before["VmRSS"] < 128 * MiB
    check_serves_a_valid_frame(fuzz_server)


# --- the health service, unknown methods, and calls without the job's credentials

HEALTH = "/grpc.health.v1.Health"
SERVING = health_pb2.HealthCheckResponse.SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
PRINTABLE = "".join(chr(c) for c in range(33, 127))


def _health_request(rng: random.Random) -> bytes:
    if rng.random() < 0.4:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 24)))
    request = health_pb2.HealthCheckRequest(service=rng.choice(
        ["", "", SERVICE, "grpc.health.v1.Health", "ü" * rng.randint(1, 5), "x" * 5000]))
    if rng.random() < 0.5:
        return b"".join(_edit_bytes(rng, [request.SerializeToString()]))
    return request.SerializeToString()


def _health_expected(request: bytes, streaming: bool) -> tuple[str, object]:
    try:
        service = health_pb2.HealthCheckRequest.FromString(request).service
    except DecodeError as e:
        return "INVALID_ARGUMENT", f"not a HealthCheckRequest: {e}"
    if streaming:
        return "OK", SERVING if service == "" else SERVICE_UNKNOWN
    return ("OK", SERVING) if service == "" else ("NOT_FOUND", "")


def _metadata(rng: random.Random) -> tuple[tuple[str, str], ...]:
    token = f"Bearer {CREDS.token}"
    auth = rng.choice([None, token, token, CREDS.token, token + "x", token[:-1], "bearer " +
                       CREDS.token, "Bearer " + "".join(rng.choices(PRINTABLE, k=10)),
                       "".join(rng.choices(PRINTABLE, k=rng.randint(1, 300)))])
    plan = rng.choice([None, CREDS.fingerprint, CREDS.fingerprint, "plan-other",
                       CREDS.fingerprint + " ", "".join(rng.choices(PRINTABLE, k=8))])
    return tuple((key, value) for key, value in (("authorization", auth),
                                                 ("x-ravnest-plan", plan)) if value is not None)


def test_fuzzed_health_unknown_method_and_unauthenticated_calls_get_a_status(
        fuzz_server: FuzzServer) -> None:
    rng = random.Random(SEED + 1)
    channel = fuzz_server.channel
    check = channel.unary_unary(f"{HEALTH}/Check", request_serializer=None,
                                response_deserializer=health_pb2.HealthCheckResponse.FromString)
    watch = channel.unary_stream(f"{HEALTH}/Watch", request_serializer=None,
                                 response_deserializer=health_pb2.HealthCheckResponse.FromString)
    unknown = [channel.unary_unary(method, request_serializer=None, response_deserializer=None)
               for method in (f"{HEALTH}/List", f"/{SERVICE}/Receive", "/ravnest.v1.Other/Send",
                              "/x")]
    outcomes: Counter[str] = Counter()
    wrong: list[str] = []
    accepted: Counter[str] = Counter()
    cases = 2000
    for case in range(cases):
        kind = rng.choices(["check", "watch", "unknown", "credentials"], [40, 8, 7, 45])[0]
        if kind == "credentials":
            messages = CATEGORIES[rng.choice(["valid", "header-edit", "random-bytes"])](rng)
            metadata = _metadata(rng)
            md = dict(metadata)
            if md.get("authorization") != f"Bearer {CREDS.token}":
                want: tuple[str, object] = ("UNAUTHENTICATED", "missing or wrong job token")
            elif md.get("x-ravnest-plan") != CREDS.fingerprint:
                want = ("FAILED_PRECONDITION", "peer runs a different plan (fingerprint mismatch)")
            else:
                want = expected(messages, LIMIT)
            got = fuzz_server.call(messages, metadata)
            if got == want and got[0] == "OK":
                accepted[decode_wire(iter(messages), LIMIT).kind] += 1
        elif kind == "unknown":
            metadata = rng.choice([(), CREDS.metadata()])
            want = ("UNIMPLEMENTED", "Method not found!")
            try:
                rng.choice(unknown)(bytes(rng.randrange(256) for _ in range(rng.randint(0, 9))),
                                    metadata=metadata, timeout=TIMEOUT)
                got = ("OK", None)
            except grpc.RpcError as e:
                got = (e.code().name, e.details())
            if got[0] == "UNAUTHENTICATED" and metadata == ():
                want = got  # Peer methods ask for the token before looking the method up
        else:
            request = _health_request(rng)
            want = _health_expected(request, streaming=kind == "watch")
            try:
                if kind == "check":
                    reply = check(request, timeout=TIMEOUT)
                    got = ("OK", reply.status)
                else:
                    stream = watch(request, timeout=TIMEOUT)
                    try:
                        got = ("OK", next(stream).status)
                    finally:
                        stream.cancel()
            except grpc.RpcError as e:
                got = (e.code().name, e.details())
        outcomes[f"{kind}:{got[0]}"] += 1
        if got != want:
            wrong.append(f"case {case} ({kind}): got {got!r:.300}, want {want!r:.300}")
    print(f"\nhealth/unknown-method/credentials fuzz: {cases} cases (seed {SEED + 1}); answers "
          f"{dict(sorted(outcomes.items()))}")
    assert not wrong, f"{len(wrong)} unexpected answers:\n" + "\n".join(wrong[:20])
    assert outcomes["credentials:UNAUTHENTICATED"] > 100
    assert outcomes["check:INVALID_ARGUMENT"] > 50 and outcomes["check:OK"] > 50
    assert fuzz_server.alive()
    last = check_serves_a_valid_frame(fuzz_server)
    accepted["forward"] += 1
    assert fuzz_server.finish() == {"delivered": dict(accepted), "last": digest(last)}
