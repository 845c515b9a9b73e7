"""Wire decoders take hostile bytes: only `KVBusError` subclasses come out, never a crash."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbus.bus.chunking import ChunkPlan, ChunkSource, chunk_digest, split_inline, tree_digest
from kvbus.errors import KVBusError, WireFormatError
from kvbus.protocol import (
    Ack,
    AgentRecord,
    Control,
    Grant,
    GroupHeartbeat,
    Open,
    OpenReply,
    Ping,
    Probe,
    RequestAck,
    TransferDone,
    TransferRequest,
    decode_message,
)
from kvbus.signature import ModelSignature

MESSAGES = [
    TransferRequest,
    RequestAck,
    Grant,
    Control,
    TransferDone,
    Probe,
    AgentRecord,
    GroupHeartbeat,
    Open,
    OpenReply,
    Ack,
    Ping,
]
CI = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=20,
)


@CI
@given(data=st.binary(max_size=512))
def test_random_bytes_never_crash_any_decoder(data: bytes) -> None:
    for cls in MESSAGES:
        try:
            cls.decode(data)
        except KVBusError:
            pass
    try:
        Open.unframe(data)
    except KVBusError:
        pass
    try:
        decode_message(data, Grant, Control, RequestAck)
    except KVBusError:
        pass


@CI
@given(
    cls=st.sampled_from(MESSAGES),
    body=st.dictionaries(st.text(max_size=12), msgpack_values, max_size=12),
    keep=st.booleans(),
)
def test_random_maps_with_the_right_tag_give_wire_errors(cls: type, body: dict, keep: bool) -> None:
    body["t"] = cls.TYPE
    if keep:
        body["v"] = 1
    try:
        cls.decode(msgpack.packb(body, use_bin_type=True))
    except WireFormatError:
        pass


@CI
@given(cls=st.sampled_from(MESSAGES), field=st.integers(0, 30), value=msgpack_values)
def test_a_valid_message_with_one_field_replaced_is_accepted_or_rejected_cleanly(
    cls: type, field: int, value: object
) -> None:
    body = msgpack.unpackb(_example(cls).encode())
    keys = sorted(k for k in body if k not in ("t", "v"))
    body[keys[field % len(keys)]] = value
    try:
        cls.decode(msgpack.packb(body, use_bin_type=True))
    except WireFormatError:
        pass


def _example(cls: type) -> object:
    examples = {
        TransferRequest: TransferRequest("t", "a", ["b"], "g", 3, 10, {"model": "m"}),
        RequestAck: RequestAck("t", True),
        Grant: Grant("t", "full", 1.0),
        Control: Control("t", "pause"),
        TransferDone: TransferDone("t", "a", True, "full", 1, 0.1),
        Probe: Probe("a", "g", 1, 2, 0.5, 1.0),
        AgentRecord: AgentRecord("a", "g", "r", 1.0, None),
        GroupHeartbeat: GroupHeartbeat("g", "s"),
        Open: Open("t", "a", "full", {}, [1], 1, 1024, 1, "0" * 32, 4, "d", "a"),
        OpenReply: OpenReply("t", True),
        Ack: Ack("t", "b", 0, 0),
        Ping: Ping("t", "a"),
    }
    return examples[cls]


@pytest.mark.parametrize("cls", MESSAGES)
def test_every_message_round_trips(cls: type) -> None:
    msg = _example(cls)
    assert cls.decode(msg.encode()) == msg


def test_messages_over_the_size_limit_are_refused_before_parsing() -> None:
    with pytest.raises(WireFormatError, match="over the limit"):
        Grant.decode(b"\x00" * (2 << 20))


@CI
@given(sizes=st.lists(st.integers(0, 5000), max_size=40), chunk=st.integers(16, 4096))
def test_chunk_plan_covers_every_byte_once_and_keeps_small_buffers_whole(sizes: list[int], chunk: int) -> None:
    plan = ChunkPlan(sizes, chunk)
    pos = 0
    for lo, hi in plan.ranges:
        assert lo == pos and 0 < hi - lo <= chunk
        pos = hi
    assert pos == plan.total == sum(sizes)
    for i in range(plan.n_chunks):
        pieces = plan.pieces(i)
        assert sum(e - s for _, s, e in pieces) == plan.ranges[i][1] - plan.ranges[i][0]
        for b, s, e in pieces:
            if sizes[b] <= chunk:
                assert (s, e) == (0, sizes[b]), "a buffer that fits a chunk must not straddle two"


@CI
@given(sizes=st.lists(st.integers(0, 50_000), max_size=60), chunk=st.integers(16, 8192))
def test_chunk_plan_count_is_its_size_without_building_it(sizes: list[int], chunk: int) -> None:
    """`ChunkPlan.count` (what a receiver checks before it builds a plan) is the plan's chunk count,
    and the compact plan's ranges are the chunks back to back."""
    plan = ChunkPlan(sizes, chunk)
    assert ChunkPlan.count(sizes, chunk) == plan.n_chunks == len(plan.ranges)
    assert list(plan.ranges) == [plan.ranges[i] for i in range(plan.n_chunks)]


@CI
@given(sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=8), chunk=st.integers(1024, 4096), data=st.data())
def test_chunk_verifier_takes_exactly_the_senders_chunks(sizes: list[int], chunk: int, data: st.DataObject) -> None:
    import os

    from kvbus.bus.chunking import ChunkVerifier, digest_chunks

    src = ChunkSource([memoryview(os.urandom(n)) for n in sizes], chunk)
    chunks = [bytes(src.chunk(i)) for i in range(src.n_chunks)]
    verifier = ChunkVerifier(src.plan, digest_chunks(chunks))
    i = data.draw(st.integers(0, src.n_chunks - 1))
    assert verifier.check(i, chunks[i])
    flip = data.draw(st.integers(0, len(chunks[i]) - 1))
    forged = bytearray(chunks[i])
    forged[flip] ^= 1
    assert not verifier.check(i, bytes(forged))
    assert not verifier.check(i, chunks[i][:-1])


@CI
@given(sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=12), chunk=st.integers(64, 2048))
def test_chunk_source_reassembles_the_buffers(sizes: list[int], chunk: int) -> None:
    import os

    from kvbus.bus.chunking import Reassembly

    buffers = [memoryview(os.urandom(n)) for n in sizes]
    src = ChunkSource(buffers, chunk)
    re = Reassembly(sizes, chunk)
    digests = []
    for i in reversed(range(src.n_chunks)):
        data = bytes(src.chunk(i))
        re.add(i, data)
    for i in range(src.n_chunks):
        digests.append(chunk_digest(src.chunk(i)))
    assert [bytes(b) for b in re.result()] == [bytes(b) for b in buffers]
    flat = memoryview(b"".join(bytes(b) for b in buffers))
    opened = Open(
        "t", "a", "full", {}, sizes, sum(sizes), chunk, src.n_chunks, tree_digest(digests, sum(sizes)), 4, "d", "a"
    )
    got, digest = split_inline(opened, flat)
    assert digest == opened.digest
    assert [bytes(b) for b in got] == [bytes(b) for b in buffers]


@CI
@given(
    body=st.dictionaries(
        st.sampled_from(["model", "n_layers", "n_kv_heads", "head_dim", "dtype", "vocab_size", "rope_theta", "x"]),
        msgpack_values,
    )
)
def test_model_signature_decoder_rejects_garbage(body: dict) -> None:
    try:
        ModelSignature.from_dict(body)
    except WireFormatError:
        pass


def test_model_signature_round_trip_and_compatibility() -> None:
    a = ModelSignature("m", 2, 2, 64, "bfloat16", 100)
    assert ModelSignature.from_dict(a.to_dict()) == a
    assert a.compatible_with(ModelSignature("m", 2, 2, 64, "float32", 100))
    assert not a.compatible_with(ModelSignature("m", 3, 2, 64, "bfloat16", 100))
    with pytest.raises(WireFormatError, match="n_layers"):
        ModelSignature.from_dict({**a.to_dict(), "n_layers": -1})


@settings(max_examples=60, deadline=None)
@given(
    tid=st.text(alphabet="abcdef0123456789", min_size=1, max_size=40),
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=6).filter(any),
)
def test_an_inline_payload_starts_aligned_in_its_message_and_comes_back_whole(tid: str, sizes: list[int]) -> None:
    import os

    from kvbus.protocol.framing import PAYLOAD_ALIGN

    pieces = [os.urandom(n) for n in sizes]
    payload = b"".join(pieces)
    msg = Open(tid, "a", "full", {}, [len(payload)], len(payload), 4096, 1, "0" * 32, 4, "d", "a", inline=True)
    framed = b"".join(msg.frame_views(pieces))
    assert framed == msg.frame(payload)
    if payload:
        assert (len(framed) - len(payload)) % PAYLOAD_ALIGN == 0  # tensors view it in place
    back, inline = Open.unframe(framed)
    assert back.transfer_id == tid and bytes(inline) == payload
    if payload and len(framed) - len(payload) > len(msg.encode()) + 4:  # there is padding: it must be zeros
        bad = bytearray(framed)
        bad[len(framed) - len(payload) - 1] = 1
        with pytest.raises(WireFormatError, match="padding"):
            Open.unframe(bytes(bad))


@settings(max_examples=300, deadline=None)
@given(
    items=st.lists(
        st.one_of(
            st.integers(-(2**70), 2**70),
            st.booleans(),
            st.floats(allow_nan=True),
            st.text(max_size=2),
            st.none(),
        ),
        max_size=12,
    ),
    lo=st.integers(-5, 5),
    span=st.integers(0, 2**60),
)
def test_a_list_of_bounded_ints_is_taken_exactly_when_each_entry_passes_its_own_check(
    items: list, lo: int, span: int
) -> None:
    """The one-pass check of a list of plain ints in range (an Open's ``sizes``) takes what the
    check per entry takes, and refuses the rest with the per-entry error."""
    from kvbus.protocol.wire import ListOf, int_in

    kind = ListOf(int_in(lo, lo + span))

    def each() -> None:
        for item in items:
            kind.element.check("m", "f[]", item)

    try:
        each()
        expected: str | None = None
    except WireFormatError as exc:
        expected = str(exc)
    if expected is None:
        assert kind.check("m", "f", items) is items
    else:
        with pytest.raises(WireFormatError) as err:
            kind.check("m", "f", items)
        assert str(err.value) == expected
