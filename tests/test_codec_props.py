"""Property-based round trips of the codec in both encodings, the wire shape a plain msgpack
reader sees, and fuzzing of ``decode_batch`` (it returns a batch or raises DecodeError, nothing else).

Hypothesis runs derandomized with a bounded ``max_examples`` so the file is deterministic and
takes a few seconds.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import kvevents
from kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

_SETTINGS = dict(
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

UINT64_MAX = 2**64 - 1
INT64_MIN = -(2**63)

# --- strategies ------------------------------------------------------------------------------

uint64_hash = st.integers(min_value=0, max_value=UINT64_MAX)
neg_int64_hash = st.integers(min_value=INT64_MIN, max_value=-1)
bytes_hash = st.binary(min_size=0, max_size=40)
block_hash = st.one_of(uint64_hash, neg_int64_hash, bytes_hash, st.sampled_from([0, UINT64_MAX, INT64_MIN, -1]))

small_text = st.text(max_size=12)
opt_text = st.none() | small_text
medium = st.one_of(st.sampled_from([None, "GPU", "CPU", "STORAGE"]), small_text)
token = st.integers(min_value=0, max_value=2**31 - 1) | st.integers(min_value=INT64_MIN, max_value=UINT64_MAX)
tokens = st.lists(token, max_size=24)
opt_small_int = st.none() | st.integers(min_value=0, max_value=2**31 - 1)

# extra_keys is ``list[Any] | None``; values must round-trip exactly through msgpack, so lists
# (not tuples), str-keyed dicts, no NaN.
_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=INT64_MIN, max_value=UINT64_MAX),
    st.floats(allow_nan=False),
    small_text,
    st.binary(max_size=16),
)
any_value = st.recursive(
    _scalar,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(small_text, inner, max_size=3),
    max_leaves=10,
)
extra_keys = st.none() | st.lists(st.none() | st.lists(any_value, max_size=3), max_size=4)


@st.composite
def block_stored(draw) -> BlockStored:
    return BlockStored(
        block_hashes=draw(st.lists(block_hash, max_size=8)),
        parent_block_hash=draw(st.none() | block_hash),
        token_ids=draw(tokens),
        block_size=draw(st.sampled_from([0, 16]) | st.integers(min_value=0, max_value=2**20)),
        lora_id=draw(opt_small_int),
        medium=draw(medium),
        lora_name=draw(opt_text),
        extra_keys=draw(extra_keys),
        group_idx=draw(opt_small_int),
        kv_cache_spec_kind=draw(st.none() | st.sampled_from(["full_attention", "sliding_window"]) | small_text),
        kv_cache_spec_sliding_window=draw(opt_small_int),
        locality=draw(opt_text),
        ownership=draw(opt_text),
        session_id=draw(opt_text),
        lookahead_token_ids=draw(st.none() | st.lists(st.lists(token, max_size=4), max_size=3)),
    )


@st.composite
def block_removed(draw) -> BlockRemoved:
    return BlockRemoved(
        block_hashes=draw(st.lists(block_hash, max_size=8)),
        medium=draw(medium),
        group_idx=draw(opt_small_int),
        locality=draw(opt_text),
        ownership=draw(opt_text),
    )


event = st.one_of(block_stored(), block_removed(), st.just(AllBlocksCleared()))

batch = st.builds(
    KVEventBatch,
    ts=st.floats(allow_nan=False),
    events=st.lists(event, max_size=6),
    data_parallel_rank=st.none() | st.integers(min_value=0, max_value=1024),
)

#: Fields vLLM 0.33 added; the legacy (0.22) layout cannot carry them.
NEW_IN_033 = {
    BlockStored: ("locality", "ownership", "session_id", "lookahead_token_ids"),
    BlockRemoved: ("locality", "ownership"),
    AllBlocksCleared: (),
}


def _defaults(cls) -> dict:
    fields = cls.__struct_fields__
    return dict(zip(fields[len(fields) - len(cls.__struct_defaults__) :], cls.__struct_defaults__))


def _as_legacy_sees_it(ev):
    return msgspec.structs.replace(ev, **{f: None for f in NEW_IN_033[type(ev)]})


def _assert_same_batch(got: KVEventBatch, want: KVEventBatch) -> None:
    assert type(got) is KVEventBatch
    assert got.ts == want.ts
    assert got.data_parallel_rank == want.data_parallel_rank
    assert len(got.events) == len(want.events)
    for g, w in zip(got.events, want.events):
        assert type(g) is type(w)
        for f in w.__struct_fields__:
            gv, wv = getattr(g, f), getattr(w, f)
            assert gv == wv, f
            if f in ("block_hashes",):  # int stays int, bytes stay bytes
                assert [type(h) for h in gv] == [type(h) for h in wv], f
            elif f == "parent_block_hash":
                assert type(gv) is type(wv), f


# --- round trips -----------------------------------------------------------------------------


@settings(max_examples=120, **_SETTINGS)
@given(batch)
def test_current_encoding_round_trips_every_field(b: KVEventBatch) -> None:
    payload = kvevents.encode_batch(b)
    _assert_same_batch(kvevents.decode_batch(payload), b)
    # The reusable classes agree with the module functions byte for byte.
    assert kvevents.BatchEncoder().encode(b) == payload
    _assert_same_batch(kvevents.BatchDecoder().decode(memoryview(payload)), b)


@settings(max_examples=120, **_SETTINGS)
@given(batch)
def test_legacy_encoding_round_trips_022_fields_and_resets_033_fields(b: KVEventBatch) -> None:
    payload = kvevents.encode_batch(b, legacy=True)
    assert kvevents.BatchEncoder(legacy=True).encode(b) == payload
    want = KVEventBatch(ts=b.ts, events=[_as_legacy_sees_it(e) for e in b.events], data_parallel_rank=b.data_parallel_rank)
    _assert_same_batch(kvevents.decode_batch(payload), want)


@settings(max_examples=50, **_SETTINGS)
@given(batch)
def test_reencoding_a_decoded_batch_is_byte_identical(b: KVEventBatch) -> None:
    payload = kvevents.encode_batch(b)
    assert kvevents.encode_batch(kvevents.decode_batch(payload)) == payload
    legacy = kvevents.encode_batch(b, legacy=True)
    assert kvevents.encode_batch(kvevents.decode_batch(legacy), legacy=True) == legacy


# --- the wire shape, as a plain msgpack reader sees it ---------------------------------------


@settings(max_examples=80, **_SETTINGS)
@given(batch)
def test_current_encoding_has_vllms_documented_shape(b: KVEventBatch) -> None:
    raw = msgspec.msgpack.decode(kvevents.encode_batch(b))
    assert isinstance(raw, list)
    # [ts, events, data_parallel_rank], always three: msgspec does not drop trailing defaults of an
    # array_like struct, and vLLM 0.33's EventBatch writes a None rank as nil too.
    assert len(raw) == 3 and raw[2] == b.data_parallel_rank
    assert raw[0] == b.ts and isinstance(raw[0], float)
    assert isinstance(raw[1], list) and len(raw[1]) == len(b.events)
    for wire, ev in zip(raw[1], b.events):
        cls = type(ev)
        assert isinstance(wire, dict)
        keys = list(wire)
        assert keys[0] == "type" and wire["type"] == cls.__name__
        defaults = _defaults(cls)
        expected_keys = [
            f for f in cls.__struct_fields__ if f not in defaults or getattr(ev, f) != defaults[f]
        ]
        assert keys[1:] == expected_keys, "required fields always, defaulted ones only when set, in struct order"
        for f in expected_keys:
            assert wire[f] == getattr(ev, f), f


@settings(max_examples=80, **_SETTINGS)
@given(batch)
def test_legacy_encoding_is_tagged_arrays(b: KVEventBatch) -> None:
    raw = msgspec.msgpack.decode(kvevents.encode_batch(b, legacy=True))
    assert isinstance(raw, list) and len(raw) == 3
    assert raw[0] == b.ts and raw[2] == b.data_parallel_rank
    for wire, ev in zip(raw[1], b.events, strict=True):
        assert isinstance(wire, list)
        assert wire[0] == type(ev).__name__
        if isinstance(ev, BlockStored):
            assert len(wire) == 12  # tag + the 11 fields of 0.22
            assert wire[1:] == [
                ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size, ev.lora_id,
                ev.medium, ev.lora_name, ev.extra_keys, ev.group_idx, ev.kv_cache_spec_kind,
                ev.kv_cache_spec_sliding_window,
            ]
        elif isinstance(ev, BlockRemoved):
            assert wire == ["BlockRemoved", ev.block_hashes, ev.medium, ev.group_idx]
        else:
            assert wire == ["AllBlocksCleared"]


# --- fuzzing decode_batch --------------------------------------------------------------------


def _decodes_or_raises_decode_error(payload: bytes) -> None:
    try:
        out = kvevents.decode_batch(payload)
    except kvevents.DecodeError as exc:
        assert str(exc), "a DecodeError must say what was wrong"
        return
    # Any other exception type propagates and fails the test.
    assert type(out) is KVEventBatch
    for ev in out.events:
        assert type(ev) in (BlockStored, BlockRemoved, AllBlocksCleared)


# Regression: a current-decode ValidationError followed by a truncated legacy event used to
# leak a bare msgspec.DecodeError out of the legacy fallback.
_TRUNCATED_LEGACY = msgspec.msgpack.encode([1.0, [["BlockStored", [1], None]], None])[:-3]


@settings(max_examples=300, **_SETTINGS)
@given(st.binary(max_size=256))
@example(b"")
@example(b"\xc1")  # never-used msgpack byte
@example(b"\x93")  # truncated array header
@example(_TRUNCATED_LEGACY)
@example(b"\x91" * 10_000)  # deeply nested arrays
def test_decode_random_bytes(payload: bytes) -> None:
    _decodes_or_raises_decode_error(payload)


# msgpack values shaped like a batch, and anything at all.
_event_like = st.one_of(
    st.dictionaries(
        st.sampled_from(["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "medium", "zzz"]),
        st.one_of(any_value, st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Nope"])),
        max_size=6,
    ),
    st.lists(
        st.one_of(any_value, st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"])), max_size=13
    ),
    any_value,
)
_batch_like = st.lists(
    st.one_of(st.floats(allow_nan=False), st.integers(), st.lists(_event_like, max_size=4), any_value),
    max_size=4,
)


@settings(max_examples=150, **_SETTINGS)
@given(st.one_of(any_value, _batch_like, st.tuples(st.floats(allow_nan=False), st.lists(_event_like, max_size=4))))
def test_decode_random_msgpack_values(value) -> None:
    try:
        payload = msgspec.msgpack.encode(value)
    except (OverflowError, msgspec.EncodeError):
        return  # hypothesis drew an int msgpack cannot hold
    _decodes_or_raises_decode_error(payload)


@settings(max_examples=150, **_SETTINGS)
@given(batch, st.booleans(), st.data())
def test_decode_truncated_or_corrupted_valid_payloads(b: KVEventBatch, legacy: bool, data) -> None:
    payload = kvevents.encode_batch(b, legacy=legacy)
    cut = data.draw(st.integers(min_value=0, max_value=max(0, len(payload) - 1)), label="cut")
    _decodes_or_raises_decode_error(payload[:cut])
    if payload:
        i = data.draw(st.integers(min_value=0, max_value=len(payload) - 1), label="flip_at")
        byte = data.draw(st.integers(min_value=0, max_value=255), label="byte")
        _decodes_or_raises_decode_error(payload[:i] + bytes([byte]) + payload[i + 1 :])


def _store_with_extra_keys(encoded_extra_keys: bytes) -> bytes:
    head = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [],
                "block_size": 0, "lora_id": None, "medium": None, "lora_name": None, "extra_keys": None}], 0]
    )
    i = head.rindex(b"\xc0")  # the extra_keys value
    return head[:i] + encoded_extra_keys + head[i + 1 :]


@pytest.mark.parametrize(
    "payload",
    [
        # deeper than any interpreter's C recursion limit (3.12+ lets msgspec decode 5,000 levels;
        # 3.11 stops earlier): a DecodeError everywhere, never a RecursionError or a crash
        pytest.param(_store_with_extra_keys(b"\x91" * 100_000 + b"\x00"), id="extra_keys-nested-100000-deep"),
        pytest.param(
            msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}], 0]).replace(
                b"\xa3GPU", b"\xa3\x80PU"
            ),
            id="invalid-utf8-in-medium",
        ),
        pytest.param(
            msgspec.msgpack.encode([1.0, [["BlockRemoved", [1], None, None]], 0]).replace(
                b"\xacBlockRemoved", b"\xac\x80lockRemoved"
            ),
            id="invalid-utf8-in-legacy-tag",
        ),
        pytest.param(_TRUNCATED_LEGACY, id="truncated-legacy-after-map-validation-error"),
    ],
)
def test_decode_hostile_payloads_raise_decode_error(payload: bytes) -> None:
    with pytest.raises(kvevents.DecodeError):
        kvevents.decode_batch(payload)


def test_decode_error_is_a_kvevents_error() -> None:
    with pytest.raises(kvevents.KVEventsError):
        kvevents.decode_batch(b"\xc1")


@settings(max_examples=100, deadline=None)
@given(ts=st.floats(allow_nan=False), rank=st.none() | st.integers(0, 7))
def test_peek_ts_reads_the_ts_without_decoding(ts, rank):
    from kvevents import AllBlocksCleared, KVEventBatch, encode_batch, peek_ts

    for legacy in (False, True):
        payload = encode_batch(KVEventBatch(ts, [AllBlocksCleared()], rank), legacy=legacy)
        assert peek_ts(payload) == ts
    assert peek_ts(b"") is None and peek_ts(b"\x93\xc0\x90\x00\x00\x00") is None and peek_ts(b"\x81\xa1a\x01xx") is None
