"""Every wire decoder under hostile input: only `KVBusError` comes out, memory stays bounded.

Each property runs 1,000 cases in CI and 100,000 in the slow job (``KVBUS_SLOW=1 pytest -m slow
tests/test_fuzz.py``). A last test sends malformed and oversized messages from a misbehaving
client to a real agent's and a real scheduler's subjects while other agents transfer.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import os
from collections.abc import Callable
from typing import Any

import msgpack
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbus.bus import Bus, BusConfig
from kvbus.bus.chunking import ChunkSource, check_open_plan, chunk_digest, digest_chunks, digests_root
from kvbus.bus.incoming import IncomingTransfer
from kvbus.cachetier.errors import RecordFormatError
from kvbus.cachetier.record import Stub, parse_record
from kvbus.codecs import Encoded, available_codecs, get_codec
from kvbus.errors import KVBusError
from kvbus.protocol import (
    AGENT_TO_SCHED,
    CHUNK_INDEX_HEADER,
    CHUNK_SUM_HEADER,
    MAX_BUFFERS,
    MAX_CHUNKS,
    MAX_CONTROL_BYTES,
    ROOT_SUM_HEADER,
    AnyValue,
    ListOf,
    Num,
    Open,
    Reason,
    ack_subject,
    agent_subject,
    data_subject,
    decode_message,
    field_types,
    inbox_subject,
    message_types,
    sched_subject,
)
from tests.conftest import FAST
from tests.kvutil import kv_of_bytes
from tests.peer import SIG

#: (cases, marks): 10^3 in every run, 10^5 in the slow job.
BUDGETS = [pytest.param(1_000, id="1e3"), pytest.param(100_000, id="1e5", marks=pytest.mark.slow)]
#: Resident memory a fuzz run may add after its first batch (decoders must not allocate what a
#: header claims, nor keep anything per message).
RSS_BOUND = 256 << 20
#: Cases per hypothesis run: a run keeps a record of every case it tried (hundreds of MB at 10^5,
#: which is hypothesis's, not ours), so big budgets run as batches (each with its own random seed).
BATCH = 5_000

# The core protocol's messages only: the registry also holds those of whatever integration was
# imported earlier in the session (the vLLM connector's, fuzzed in tests/test_vllm_parts.py), and
# what this module checks must not depend on the test order.
MESSAGES = [m for m in message_types() if m.__module__.startswith("kvbus.protocol")]
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=16)
    | st.binary(max_size=32)
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=8,
)


def _run(cases: int, strategy: st.SearchStrategy[Any], check: Callable[[Any], None]) -> None:
    """``cases`` examples of ``strategy`` through ``check``, in batches; memory must stay bounded.

    The decoders' warnings about hostile input are silenced meanwhile (pytest would keep every
    record in memory). The memory bound is checked from the end of the first batch (imports,
    caches and the allocator's first growth are in it) to the end of the last.
    """
    batches = [min(BATCH, cases - done) for done in range(0, cases, BATCH)]
    # One batch: from before it; more: from the end of the first.
    base = psutil.Process().memory_info().rss if len(batches) == 1 else None
    logging.disable(logging.WARNING)
    try:
        for n in batches:

            @settings(
                max_examples=n,
                deadline=None,
                database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
            )
            @given(strategy)
            def prop(value: Any) -> None:
                check(value)

            prop()
            gc.collect()
            if base is None:
                base = psutil.Process().memory_info().rss
    finally:
        logging.disable(logging.NOTSET)
    grown = psutil.Process().memory_info().rss - base
    counted = cases if len(batches) == 1 else cases - batches[0]
    assert grown < RSS_BOUND, f"resident memory grew by {grown >> 20} MB over {counted} cases"


def _only_kvbus_errors(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except KVBusError:
        pass


# -- control messages: grants, probes, leases, requests, acks, opens ... -----------------------------


def _message_bytes() -> st.SearchStrategy[tuple[type, bytes]]:
    tagged = st.tuples(
        st.sampled_from(MESSAGES), st.dictionaries(st.text(max_size=12), VALUES, max_size=6), st.booleans()
    )

    def pack(item: tuple[type, dict, bool]) -> tuple[type, bytes]:
        cls, body, versioned = item
        body = {**body, "t": cls.TYPE, **({"v": 1} if versioned else {})}
        return cls, msgpack.packb(body, use_bin_type=True)

    raw = st.tuples(st.sampled_from(MESSAGES), st.binary(max_size=512))
    return tagged.map(pack) | raw


@pytest.mark.parametrize("cases", BUDGETS)
def test_control_message_decoders(cases: int) -> None:
    def check(item: tuple[type, bytes]) -> None:
        cls, data = item
        _only_kvbus_errors(lambda: cls.decode(data))
        _only_kvbus_errors(lambda: decode_message(data, *MESSAGES))
        _only_kvbus_errors(lambda: Open.unframe(len(data).to_bytes(4, "big") + data + b"payload"))

    _run(cases, _message_bytes(), check)
    _only_kvbus_errors(lambda: MESSAGES[0].decode(b"\x00" * (MAX_CONTROL_BYTES + 1)))


# -- numeric edge values in every field of every message ------------------------------------------------

#: What a hostile peer puts where a number belongs (2**64 itself does not fit msgpack: see below).
EDGE_NUMBERS = [
    math.nan,
    math.inf,
    -math.inf,
    -0.0,
    -1,
    -1.5,
    -(2**63),
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**53 + 1,
    1e300,
    -1e300,
    5e-324,
    0,
    1,
    True,
]
EDGE_VALUES = (
    st.sampled_from(EDGE_NUMBERS)
    | st.sampled_from(EDGE_NUMBERS).map(lambda x: [x])
    | st.sampled_from(EDGE_NUMBERS).map(lambda x: {"x": x, "nested": [1.0, {"y": x}]})
)


def _valid(kind: Any) -> Any:
    """A value every decoder accepts for a field of this wire type."""
    if isinstance(kind, Num):
        return kind.kind(max(kind.lo, min(kind.hi, 1)))
    if isinstance(kind, ListOf):
        return [_valid(kind.element)] if isinstance(kind.element, Num) else ["a"]
    if isinstance(kind, tuple):
        return _valid(kind[0])
    if kind is AnyValue:
        return None
    if isinstance(kind, type) and issubclass(kind, Reason):
        return ""
    return {str: "x", bool: False, int: 1, float: 1.0, dict: {}, list: [], bytes: b""}[kind]


#: Field values a message needs beyond its types (checked in ``__post_init__``).
# Fields whose valid values are not the generic ones: a path offer is all or nothing (no direct
# path offered here), path names come from `PATH_NAMES`.
_NO_PATHS = {"host": "", "paths": []}
_VALID_OVERRIDES = {
    "control": {"action": "rate"},
    "open": _NO_PATHS,
    "open_reply": {
        **_NO_PATHS,
        "shm": "",
        "tcp_host": "",
        "tcp_port": 0,
        "tls": False,
        "token": "",
        "token_ttl_s": 0.0,
    },
}


def _numeric_fields(cls: type) -> list[str]:
    """Fields where a number can go: numbers, lists, maps and any-value fields."""
    out = []
    for name, kind in field_types(cls).items():
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if any(isinstance(k, (Num, ListOf)) or k in (int, float, dict, list, AnyValue) for k in kinds):
            out.append(name)
    return out


def _all_finite(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return False
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return True


def _edge_bodies() -> st.SearchStrategy[tuple[type, dict[str, Any]]]:
    def build(cls: type) -> st.SearchStrategy[tuple[type, dict[str, Any]]]:
        body = {name: _valid(kind) for name, kind in field_types(cls).items()}
        body.update(_VALID_OVERRIDES.get(cls.TYPE, {}))
        body.update({"t": cls.TYPE, "v": 1})
        names = _numeric_fields(cls)
        if not names:
            return st.just((cls, body))
        edits = st.dictionaries(st.sampled_from(names), EDGE_VALUES, min_size=1, max_size=3)
        return edits.map(lambda e: (cls, {**body, **e}))

    return st.sampled_from(MESSAGES).flatmap(build)


def _check_decoded(msg: Any) -> None:
    """What came out of a decoder: every number finite and within its field's declared range."""
    for name, kind in field_types(type(msg)).items():
        value = getattr(msg, name)
        assert _all_finite(value), f"{type(msg).__name__}.{name} = {value!r} is not finite"
        spec = kind.element if isinstance(kind, ListOf) and isinstance(kind.element, Num) else kind
        if isinstance(spec, Num):
            for v in value if isinstance(kind, ListOf) else [value]:
                if v is None:
                    assert spec.optional, f"{type(msg).__name__}.{name} is None"
                    continue
                assert not isinstance(v, bool) and isinstance(v, (int, float)), (name, v)
                assert spec.lo <= v <= spec.hi or (spec.inf and v == math.inf), f"{name} = {v!r} outside {spec}"


def test_every_numeric_field_declares_its_range() -> None:
    """No message has a bare int or float field: each number says what range it may take."""
    bare = [
        f"{cls.TYPE}.{name}"
        for cls in MESSAGES
        for name, kind in field_types(cls).items()
        if any(k in (int, float) for k in (kind if isinstance(kind, tuple) else (kind,)))
    ]
    assert not bare, f"numeric fields without a declared range: {bare}"


def test_numbers_beyond_msgpack_do_not_reach_the_wire() -> None:
    """2**64 cannot be encoded at all: a peer cannot send it, only the largest uint64 (fuzzed above)."""
    with pytest.raises(OverflowError):
        msgpack.packb({"t": "request", "n_tokens": 2**64})


@pytest.mark.parametrize("cases", BUDGETS)
def test_numeric_edge_values_in_every_message(cases: int) -> None:
    """NaN, infinities, negatives and huge integers in every numeric field (and inside lists and
    maps) of every message type: each decodes to in-range finite numbers or raises a `KVBusError`."""
    seen: set[str] = set()

    def check(item: tuple[type, dict[str, Any]]) -> None:
        cls, body = item
        seen.add(cls.TYPE)
        data = msgpack.packb(body, use_bin_type=True)
        for decode in (
            lambda: cls.decode(data),
            lambda: decode_message(data, *MESSAGES),
            lambda: Open.unframe(len(data).to_bytes(4, "big") + data) if cls is Open else cls.decode(data),
        ):
            try:
                msg = decode()
            except KVBusError:
                continue
            _check_decoded(msg if not isinstance(msg, tuple) else msg[0])

    _run(cases, _edge_bodies(), check)
    assert seen == {cls.TYPE for cls in MESSAGES}, f"message types never fuzzed: {set(m.TYPE for m in MESSAGES) - seen}"


def test_a_valid_body_of_every_message_decodes() -> None:
    """The fuzzer's starting point is valid, so what it refuses is the edge value, not the body."""
    for cls in MESSAGES:
        body = {name: _valid(kind) for name, kind in field_types(cls).items()}
        body.update({**_VALID_OVERRIDES.get(cls.TYPE, {}), "t": cls.TYPE, "v": 1})
        _check_decoded(cls.decode(msgpack.packb(body, use_bin_type=True)))


# -- chunk frames --------------------------------------------------------------------------------------


class _Recorder:
    """The transport of a receiver under fuzz: acks it publishes are recorded, nothing else happens."""

    max_payload = 8 << 20

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, payload: Any, headers: dict[str, str] | None = None) -> None:
        self.published.append((subject, bytes(payload)))

    async def subscribe(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("not used")


class _Msg:
    def __init__(self, data: bytes, headers: dict[str, str] | None) -> None:
        self.data, self.headers, self.reply = data, headers, ""


_PAYLOAD = bytes(range(256)) * 40  # 10,240 bytes
_SIZES = [3000, 7000, 240]
_SOURCE = ChunkSource(
    [memoryview(_PAYLOAD[:3000]), memoryview(_PAYLOAD[3000:10000]), memoryview(_PAYLOAD[10000:])], 2048
)
_GENUINE = [bytes(_SOURCE.chunk(i)) for i in range(_SOURCE.n_chunks)]
_DIGESTS = [chunk_digest(c) for c in _GENUINE]


def _frames() -> st.SearchStrategy[list[tuple[bytes, dict[str, str] | None]]]:
    n = len(_GENUINE)
    genuine = st.integers(0, n - 1).map(
        lambda i: (_GENUINE[i], {CHUNK_INDEX_HEADER: str(i), CHUNK_SUM_HEADER: _DIGESTS[i]})
    )
    hostile_headers = st.none() | st.dictionaries(
        st.sampled_from([CHUNK_INDEX_HEADER, CHUNK_SUM_HEADER, ROOT_SUM_HEADER]) | st.text(max_size=8),
        st.text(max_size=40) | st.integers(-(2**70), 2**70).map(str),
        max_size=4,
    )
    hostile = st.tuples(st.binary(max_size=4096), hostile_headers)

    def forged(item: tuple[int, bytes]) -> tuple[bytes, dict[str, str]]:
        i, data = item
        # A frame whose own checksum is right but whose bytes are not the sender's.
        return data, {CHUNK_INDEX_HEADER: str(i), CHUNK_SUM_HEADER: chunk_digest(data)}

    forgery = st.tuples(st.integers(-2, n + 2), st.binary(max_size=2100)).map(forged)
    return st.lists(genuine | hostile | forgery, max_size=24)


@pytest.mark.parametrize("cases", BUDGETS)
def test_chunk_frames(cases: int) -> None:
    """Genuine, hostile and forged chunk frames (any headers, digest and root ones included) into a
    receiver's reassembly: it never raises, and whatever completes is exactly the sender's payload."""
    loop = asyncio.new_event_loop()
    config = BusConfig(chunk_size=2048)
    digests = digest_chunks(_GENUINE)
    open_msg = Open(
        transfer_id="f" * 32,
        src="tx",
        codec="full",
        meta={},
        sizes=_SIZES,
        total=sum(_SIZES),
        chunk_size=2048,
        n_chunks=len(_GENUINE),
        digest=digests_root(digests, sum(_SIZES)),
        window=16,
        data_subject=data_subject("rx", "tx", "f" * 32),
        ack_subject=ack_subject("tx", "rx"),
        digests=digests,
    )
    plan = check_open_plan(open_msg)

    def check(frames: list[tuple[bytes, dict[str, str] | None]]) -> None:
        finished: list[IncomingTransfer] = []

        async def finish(incoming: IncomingTransfer) -> None:
            finished.append(incoming)

        async def feed() -> IncomingTransfer:
            incoming = IncomingTransfer(_Recorder(), open_msg, "rx", config, finish, plan)  # type: ignore[arg-type]
            for data, headers in frames:
                await incoming._on_chunk(_Msg(data, headers))  # must never raise
            if incoming._done_task is not None:
                await incoming._done_task
            return incoming

        incoming = loop.run_until_complete(feed())
        assert incoming.count <= len(_GENUINE)
        if finished:
            # Whatever got through the Open's digests is exactly what the sender sent.
            assert incoming.verify()
            assert b"".join(bytes(b) for b in incoming.assembly.result()) == _PAYLOAD

    try:
        _run(cases, _frames(), check)
    finally:
        loop.close()


# -- Open bounds: every size and count checked before anything is allocated --------------------------------


def _edge_ints() -> st.SearchStrategy[int]:
    return st.sampled_from([-(2**63), -1, 0, 1, 1023, 1024, 4096, MAX_CHUNKS, MAX_CHUNKS + 1, 2**31, 2**48, 2**63 - 1])


def _opens() -> st.SearchStrategy[dict[str, Any]]:
    """Open bodies whose numbers are edge values: NaN, inf, negative, huge, at and over every limit."""
    number = _edge_ints() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    sizes = st.lists(_edge_ints() | st.integers(0, 1 << 20), max_size=8) | st.builds(
        lambda n, k: [n] * k, st.integers(0, 4096), st.sampled_from([1, 2, MAX_BUFFERS, MAX_BUFFERS + 1])
    )
    return st.fixed_dictionaries(
        {
            "t": st.just("open"),
            "v": st.just(1),
            "transfer_id": st.just("o" * 32),
            "src": st.just("tx"),
            "codec": st.just("full"),
            "meta": st.just({}),
            "sizes": sizes,
            "total": number,
            "chunk_size": number,
            "n_chunks": number,
            "digest": st.sampled_from(["", "0" * 32, "x" * 40]),
            "window": number,
            "data_subject": st.just("d"),
            "ack_subject": st.just("a"),
            "inline": st.booleans(),
            "digests": st.binary(max_size=64) | st.integers(0, 4).map(lambda k: bytes(8 * k)),
            "incarnation": st.text(max_size=40),
            "attempt": number,
            "retry_age": number,
        }
    )


@pytest.mark.parametrize("cases", BUDGETS)
def test_open_numbers_at_their_edges(cases: int) -> None:
    """An Open with NaN, inf, negative or huge numbers anywhere: only `KVBusError`s, and one that
    passes has a bounded chunk plan (the receiver allocates no more than that)."""

    def check(body: dict[str, Any]) -> None:
        head = msgpack.packb(body, use_bin_type=True)
        frame = len(head).to_bytes(4, "big") + head
        try:
            open_msg, _ = Open.unframe(frame)
            plan = check_open_plan(open_msg)
        except KVBusError:
            return
        assert plan.n_chunks == open_msg.n_chunks <= MAX_CHUNKS
        assert len(open_msg.sizes) <= MAX_BUFFERS and open_msg.chunk_size >= 1024
        assert 0.0 <= open_msg.retry_age < float("inf") and open_msg.attempt >= 0

    _run(cases, _opens(), check)


# -- cache tier stubs and records ------------------------------------------------------------------------


@pytest.mark.parametrize("cases", BUDGETS)
def test_cachetier_stub_and_record_decoders(cases: int) -> None:
    raw = st.binary(max_size=400) | VALUES.map(lambda v: msgpack.packb(v, use_bin_type=True))
    fields = st.dictionaries(st.binary(max_size=8) | st.text(max_size=8), st.binary(max_size=200), max_size=6)

    def check(item: tuple[bytes, dict[Any, bytes]]) -> None:
        data, record = item
        try:
            Stub.from_bytes(data)
        except RecordFormatError:
            pass
        try:
            parse_record(record, "ab" * 16)
        except KVBusError:
            pass

    _run(cases, st.tuples(raw, fields), check)


# -- codec metadata --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cases", BUDGETS)
def test_codec_metadata(cases: int) -> None:
    codecs = [c for c in available_codecs() if c not in ("summary",)]  # summary needs a generating model
    strategy = st.tuples(
        st.sampled_from(codecs),
        st.dictionaries(st.text(max_size=10), VALUES, max_size=6),
        st.binary(max_size=256),
        st.lists(st.integers(0, 64), max_size=6),
    )

    def check(item: tuple[str, dict, bytes, list[int]]) -> None:
        codec, meta, payload, sizes = item
        try:
            encoded = Encoded.from_payload(codec, meta, payload, sizes)
            out = get_codec(codec).decode(encoded)
        except KVBusError:
            return
        out.validate()
        assert out.nbytes <= 64 * len(payload) + 4096, "decoded far more than was received"

    _run(cases, strategy, check)


# -- a misbehaving client on a real server ----------------------------------------------------------------------


async def test_misbehaving_client_does_not_disturb_other_agents(bus: Bus, nats_url: str) -> None:
    other = await Bus.connect(nats_url, config=FAST)
    rogue = await Bus.connect(nats_url, config=FAST)
    try:
        tx = await bus.agent("fuzz-tx", signature=SIG)
        rx = await other.agent("fuzz-rx", signature=SIG)
        victim = await rogue.agent("fuzz-victim", signature=SIG)
        kvs = [kv_of_bytes(SIG, 6 << 20, seed=s) for s in range(3)]
        sends = asyncio.gather(*(tx.send(rx.name, kv, medium="full") for kv in kvs))
        big = os.urandom(rogue.transport.max_payload - 8192)
        junk = [
            b"",
            b"\xc1",
            b"\x92\x01",
            msgpack.packb({"t": "grant", "v": 1, "transfer_id": 7}),
            big,
            msgpack.packb({"t": "open", "v": 1, "sizes": [1 << 62], "total": 1 << 62}),
            (0xFFFFFFFF).to_bytes(4, "big") + b"x",
        ]
        # The victim's own subjects take the storm; tx and rx only get chunks for a transfer that
        # does not exist and acks they do not expect (what any agent may publish to them).
        subjects = [agent_subject(victim.name, k) for k in ("ack", "ctl")] + [inbox_subject(victim.name, "rogue")]
        subjects += [agent_subject(tx.name, "ack"), ack_subject(tx.name, rx.name)]
        subjects += [sched_subject("default", k, victim.name) for k in AGENT_TO_SCHED]
        subjects += [sched_subject("default", "state")]
        subjects += [f"kvbus.agent.{rx.name}.data.{'0' * 32}", data_subject(rx.name, "rogue", "0" * 32)]
        for _ in range(3):
            for subject in subjects:
                for payload in junk:
                    await rogue.transport.publish(subject, payload, headers={CHUNK_INDEX_HEADER: "-1"})
                    await rogue.transport.publish(subject, payload)
        for subject in subjects[:4]:
            try:
                await rogue.transport.request(subject, big, timeout=1.0)
            except Exception:
                pass
        reports = await asyncio.wait_for(sends, 60)
        # The victim still works once the storm is over.
        kv = kv_of_bytes(SIG, 1 << 20, seed=12)
        await tx.send(victim.name, kv, medium="full")
        assert (await victim.receive(timeout=10)).kv.equal(kv)
        got = {d.transfer_id: d for d in [await rx.receive(timeout=10) for _ in kvs]}
        for report, kv in zip(reports, kvs):
            assert got[report.transfer_id].kv.equal(kv)
        # Still serving after the storm.
        kv = kv_of_bytes(SIG, 1 << 20, seed=11)
        report = await tx.send(rx.name, kv, medium="full")
        assert (await rx.receive(timeout=10)).transfer_id == report.transfer_id
    finally:
        await other.close()
        await rogue.close()
