"""Property-based fuzzing of every decoder (the deterministic slice of the chaos suite; the long
runs are ``benchmarks/chaos.py`` and ``benchmarks/fuzz_native.py``)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from . import oracles

PAYLOADS = oracles.seed_payloads()
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_the_seed_corpus_decodes():
    assert len(PAYLOADS) >= 10
    assert all(oracles.check_decode(p) is not None for p in PAYLOADS)


@FAST
@given(which=st.integers(0, 10_000), seed=st.integers(0, 2**32))
def test_decode_batch_on_mutated_payloads(which, seed):
    oracles.check_decode(oracles.mutate(PAYLOADS[which % len(PAYLOADS)], random.Random(seed)))


@FAST
@given(data=st.binary(max_size=200))
def test_decode_batch_on_random_bytes(data):
    oracles.check_decode(data)


@pytest.mark.parametrize("depth", [64, 5_000, 100_000])
def test_decode_batch_on_deep_nesting(depth):
    oracles.check_decode(b"\x93\xcb" + b"\0" * 8 + b"\x91" * depth + b"\x90\x00")


@FAST
@given(which=st.integers(0, 10_000), seed=st.integers(0, 2**32))
def test_apply_payload_agrees_with_the_typed_decoder(which, seed):
    oracles.check_apply_payload(oracles.mutate(PAYLOADS[which % len(PAYLOADS)], random.Random(seed)))


@FAST
@given(seed=st.integers(0, 2**32), n=st.integers(1, 40))
def test_replay_answers_and_live_frames_in_any_order(seed, n):
    """Hostile streams through DeliveryStream (the live subscriber's SeqTracker on recorded
    input): seqs anywhere in 64 bits, answers out of order, stray end markers, bad frames."""
    oracles.check_stream(oracles.random_records(random.Random(seed), n))


SEED_REC = oracles.seed_recording()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32))
def test_the_recording_reader_on_damaged_files(seed, tmp_path):
    oracles.check_recording_bytes(oracles.damage_recording(SEED_REC, random.Random(seed)), tmp_path)


def test_the_undamaged_seed_recording_reads_whole(tmp_path):
    n, damaged = oracles.check_recording_bytes(SEED_REC, tmp_path)
    assert (n, damaged) == (15, 0)
