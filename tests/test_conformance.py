"""Wire compatibility, proven against payloads produced by real vLLM releases."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

import kvevents
from kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from .conftest import shared_dir

RELEASES = ["vllm-0.22.1", "vllm-0.33.0"]


def _cases(release: str) -> list[str]:
    manifest = json.loads((shared_dir() / "conformance" / release / "MANIFEST.json").read_text())
    return sorted(manifest["cases"])


def _unjson(value):
    if isinstance(value, dict) and set(value) == {"$bytes"}:
        return bytes.fromhex(value["$bytes"])
    if isinstance(value, list):
        return [_unjson(v) for v in value]
    return value


_TYPES = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared}


def _check_event(decoded, expected: dict) -> None:
    cls = _TYPES[expected["type"]]
    assert type(decoded) is cls
    defaults = dict(zip(cls.__struct_fields__[len(cls.__struct_fields__) - len(cls.__struct_defaults__):], cls.__struct_defaults__))
    for field in cls.__struct_fields__:
        got = getattr(decoded, field)
        if field in expected:
            assert got == _unjson(expected[field]), field
        else:  # a field this release did not have: the decoder fills its default
            assert got == defaults[field], field
    assert set(expected) - {"type"} <= set(cls.__struct_fields__), "JSON names a field we do not model"


@pytest.mark.parametrize("release,case", [(r, c) for r in RELEASES for c in _cases(r)])
def test_decodes_to_its_json(conformance_dir: Path, release: str, case: str) -> None:
    payload = (conformance_dir / release / f"{case}.msgpack").read_bytes()
    expected = json.loads((conformance_dir / release / f"{case}.json").read_text())
    batch = kvevents.decode_batch(payload)
    assert isinstance(batch, KVEventBatch)
    assert batch.ts == expected["ts"]
    assert batch.data_parallel_rank == expected["data_parallel_rank"]
    assert len(batch.events) == len(expected["events"])
    for got, want in zip(batch.events, expected["events"]):
        _check_event(got, want)


@pytest.mark.parametrize("case", _cases("vllm-0.33.0"))
def test_reencodes_byte_for_byte(conformance_dir: Path, case: str) -> None:
    payload = (conformance_dir / "vllm-0.33.0" / f"{case}.msgpack").read_bytes()
    assert kvevents.encode_batch(kvevents.decode_batch(payload)) == payload


@pytest.mark.parametrize("case", _cases("vllm-0.22.1"))
def test_legacy_encoding_matches_022_layout(conformance_dir: Path, case: str) -> None:
    """Our legacy encoding of a 0.22 batch is exactly what 0.22 sent."""
    payload = (conformance_dir / "vllm-0.22.1" / f"{case}.msgpack").read_bytes()
    assert kvevents.encode_batch(kvevents.decode_batch(payload), legacy=True) == payload


def test_live_capture_parses(conformance_dir: Path) -> None:
    lines = (conformance_dir / "vllm-0.33.0-live-pub-replay.jsonl").read_text().splitlines()
    msgs = [json.loads(line) for line in lines]
    pub = [[bytes.fromhex(f) for f in m["frames"]] for m in msgs if m["socket"] == "pub"]
    replay = [[bytes.fromhex(f) for f in m["frames"]] for m in msgs if m["socket"] == "replay"]
    assert len(pub) == 30
    for i, (topic, seq, payload) in enumerate(pub):
        assert topic == b"kv@pod-a@demo-model"
        assert int.from_bytes(seq, "big") == i
        batch = kvevents.decode_batch(payload)
        assert batch.events
        assert kvevents.encode_batch(batch) == payload
    offloads = [e for _, _, p in pub for e in kvevents.decode_batch(p).events
                if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert offloads and all(e.block_size == 0 and e.token_ids == [] for e in offloads)
    *answers, end = replay
    assert [int.from_bytes(m[2], "big") for m in answers] == list(range(20, 30))
    for empty, topic, seq, payload in answers:
        assert empty == b"" and topic == b"kv@pod-a@demo-model"
        assert payload == pub[int.from_bytes(seq, "big")][2]
    assert end == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]


def test_undecodable_payloads_raise_typed_error() -> None:
    for bad, needle in [
        (b"\xc1", "not msgpack"),
        (msgspec.msgpack.encode([1.0, [{"type": "Nope"}], 0]), "Nope"),
        (msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": ["x"]}], 0]), "block_hashes"),
        (msgspec.msgpack.encode({"ts": 1}), "KVEventBatch"),
    ]:
        with pytest.raises(kvevents.DecodeError, match=needle):
            kvevents.decode_batch(bad)


def test_tolerant_decoding() -> None:
    # unknown fields ignored, int64 (signed) hashes kept, a release lacking lora_name/medium defaulted
    payload = msgspec.msgpack.encode(
        [2, [{"type": "BlockStored", "block_hashes": [-5, 7], "parent_block_hash": None,
              "token_ids": [1], "block_size": 1, "lora_id": None, "future_field": {"x": 1}}]]
    )
    batch = kvevents.decode_batch(payload)
    ev = batch.events[0]
    assert batch.ts == 2.0 and batch.data_parallel_rank is None
    assert ev.block_hashes == [-5, 7] and ev.medium is None and ev.lora_name is None
    legacy_old = msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1, 2], 2, None]], 0])
    assert kvevents.decode_batch(legacy_old).events[0] == BlockStored([1], None, [1, 2], 2, None, None, None)
