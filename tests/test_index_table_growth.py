"""The router index's C key table grows without stopping the world (consumers/_masktable_grow.h).

Its slot table doubles incrementally (old and new tables side by side, a few old positions
moved per insert, lookups in both) and its entries live in fixed-size segments, so no single
insert moves more than a bounded number of entries. Checked here against a dict model through
growth, with deletes (evictions) and lookups while a rehash is under way, and through the
table's own growth counters (not timing).
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumers import keys as keys_mod

_FAST = keys_mod._FAST
pytestmark = pytest.mark.skipif(_FAST is None, reason="C extension not built")


class Model:
    """What MaskTable promises: dict order = LRU (setting a bit moves a key to the newest end)."""

    def __init__(self) -> None:
        self.d: OrderedDict[int, int] = OrderedDict()

    def set_bit(self, keys, b):
        fresh = 0
        for k in keys:
            if k in self.d:
                self.d.move_to_end(k)
            else:
                self.d[k] = 0
            if not self.d[k] >> b & 1:
                fresh += 1
                self.d[k] |= 1 << b
        return fresh

    def clear_bit(self, keys, b):
        gone = 0
        for k in keys:
            if k in self.d and self.d[k] >> b & 1:
                self.d[k] &= ~(1 << b)
                gone += 1
        return gone

    def entries(self):
        return sum(bin(m).count("1") for m in self.d.values())

    def evict(self, target):
        out, dropped = [], 0
        while (self.entries() > target or len(self.d) > target) and self.d:
            k, m = self.d.popitem(last=False)
            out.append(k)
            dropped += bin(m).count("1")
        return out, dropped


def _same(t, m: Model, probes=()):
    assert len(t) == len(m.d)
    assert list(t.items()) == list(m.d.items())
    assert t.entries == m.entries()
    for k in probes:
        assert (k in t) == (k in m.d)
        assert t.get(k) == m.d.get(k)


_KEY = st.integers(0, 4000) | st.integers(0, 2**64 - 1)
_OP = st.one_of(
    st.tuples(st.just("set"), st.lists(_KEY, min_size=1, max_size=300), st.integers(0, 127)),
    st.tuples(st.just("clear"), st.lists(_KEY, max_size=50), st.integers(0, 127)),
    st.tuples(st.just("evict"), st.integers(0, 3000), st.just(0)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_OP, min_size=1, max_size=40), probes=st.lists(_KEY, max_size=40))
def test_table_matches_a_dict_through_growth_and_deletes(ops, probes):
    t, m = _FAST.MaskTable(128, mig_step=2), Model()  # the slowest legal rehash: longest overlap
    for op, arg, b in ops:
        if op == "set":
            assert t.set_bit(arg, b) == m.set_bit(arg, b)
        elif op == "clear":
            assert t.clear_bit(arg, b) == m.clear_bit(arg, b)
        else:
            assert t.evict(arg) == m.evict(arg)
        _same(t, m, probes + [k for k in (arg if isinstance(arg, list) else [])][:20])


def _fill_until_rehashing(t, m, start, rehashes=1):
    """insert keys start, start+1, ... until the table's `rehashes`-th rehash is under way"""
    k = start
    while not (t.growth_stats()["rehashing"] and t.growth_stats()["rehashes"] >= rehashes):
        m.set_bit([k], k % 7)
        t.set_bit([k], k % 7)
        k += 1
    return k


def test_deletes_and_lookups_in_the_middle_of_a_rehash():
    t, m = _FAST.MaskTable(64, mig_step=2), Model()
    k = _fill_until_rehashing(t, m, 1, rehashes=7)  # 16 -> ... -> 2,048 slots: ~512 keys
    assert len(m.d) > 500
    # evict half of the keys: some still in the old table, some already moved
    assert t.evict(len(m.d) // 2) == m.evict(len(m.d) // 2)
    assert t.growth_stats()["rehashing"]
    _same(t, m, probes=range(0, k + 10, 3))
    # re-insert evicted keys (tombstones in the old table must not hide or duplicate them)
    assert t.set_bit(list(range(1, 200)), 5) == m.set_bit(list(range(1, 200)), 5)
    _same(t, m, probes=range(0, k + 10, 3))
    # updates of present keys keep moving the old table until the rehash is over
    while t.growth_stats()["rehashing"]:
        some = next(iter(m.d))
        t.set_bit([some], 9)
        m.set_bit([some], 9)
    _same(t, m, probes=range(0, k + 10, 3))
    assert t.parent(1) is None


def test_chains_and_parents_survive_a_rehash():
    t = _FAST.MaskTable(64, mig_step=2)
    chain = list(range(10_000, 12_100))  # 2,100 keys: rehashes at 8, 16, ..., 2048 keys
    t.set_chain(chain, 3, None)
    assert t.growth_stats()["rehashing"]
    assert t.walk_back(chain[-1], 5) == chain[-5:]
    assert t.keys_between(chain[-1], chain[-4], 10) == chain[-3:]
    assert all(t.parent(c) == p for p, c in zip(chain, chain[1:]))


def test_grow_relays_masks_in_the_middle_of_a_rehash():
    t, m = _FAST.MaskTable(8, mig_step=2), Model()
    _fill_until_rehashing(t, m, 1)
    t.grow(4, 64, 2)  # 2 tiers of 4 slots -> 2 tiers of 64: bit tier*4+s -> tier*64+s
    want = {k: sum(1 << ((b // 4) * 64 + b % 4) for b in range(8) if v >> b & 1) for k, v in m.d.items()}
    assert dict(t.items()) == want
    t.set_bit([10**9], 100)
    assert t[10**9] == 1 << 100 and len(t) == len(want) + 1


@pytest.mark.parametrize("bits", [128, 4096])
def test_no_insert_moves_more_than_a_bounded_number_of_entries(bits):
    n = 150_000  # past 2**17 keys: one doubling would move 65,536+ entries at once
    t = _FAST.MaskTable(bits)
    for lo in range(0, n, 5000):
        t.set_bit(list(range(lo, lo + 5000)), 1)
    s = t.growth_stats()
    assert len(t) == n and s["rehashes"] >= 13 and not s["rehashing"]
    # the counter counts: every key was moved at least once by some rehash
    assert s["moved_total"] >= n // 2
    # one insert moves at most half a segment (segment 0 doubling) plus one rehash step
    bound = s["segment_entries"] // 2 + s["mig_step"]
    assert s["moved_max"] <= bound <= 4096
    assert all(t.get(k) == 2 for k in range(0, n, 997))


def test_mig_step_is_checked():
    with pytest.raises(ValueError, match="mig_step"):
        _FAST.MaskTable(64, mig_step=1)


# ---- LearnedTable (the engine-hash -> router-key map): the same incremental rehash ----------

_LOP = st.one_of(
    st.tuples(st.just("set"), st.lists(st.tuples(_KEY, st.integers(0, 2**64 - 1)), min_size=1, max_size=200)),
    st.tuples(st.just("del"), st.lists(_KEY, max_size=150)),
    st.tuples(st.just("del_oldest"), st.integers(0, 400)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_LOP, min_size=1, max_size=40), probes=st.lists(_KEY, max_size=40))
def test_learned_table_matches_a_dict_through_growth_deletes_and_compaction(ops, probes):
    t, d = _FAST.LearnedTable(mig_step=2), {}
    for op, arg in ops:
        if op == "set":
            for k, v in arg:
                t[k] = v
                d[k] = v
        elif op == "del":
            for k in arg:
                if k in d:
                    del t[k]
                    del d[k]
                else:
                    with pytest.raises(KeyError):
                        del t[k]
        else:  # what the bounded learned map does: drop the oldest
            for k in t.oldest(arg):
                del t[k]
                del d[k]
        assert len(t) == len(d) and list(t.items()) == list(d.items())
        for k in probes:
            assert (k in t) == (k in d) and t.get(k) == d.get(k)


def test_learned_table_deletes_in_the_middle_of_a_rehash_and_bounded_steps():
    t, d = _FAST.LearnedTable(mig_step=2), {}
    k = 0
    while not (t.growth_stats()["rehashing"] and t.growth_stats()["rehashes"] >= 7):
        t[k] = d[k] = k * 3
        k += 1
    for j in list(d)[::2]:  # half of them, in both the old and the new index
        del t[j]
        del d[j]
    assert t.growth_stats()["rehashing"]
    assert list(t.items()) == list(d.items())
    assert all((j in t) == (j in d) for j in range(k + 10))
    for j in range(k, k + 200_000):  # past 2**17 keys, several more rehashes
        t[j] = d[j] = j
    s = t.growth_stats()
    assert s["rehashes"] >= 12 and s["moved_max"] <= s["mig_step"]
    assert len(t) == len(d) and all(t[j] == d[j] for j in range(0, k + 200_000, 991) if j in d)


def test_learned_table_compacts_incrementally_with_bounded_work():
    """A bounded learned map at steady state (new keys in, the oldest out in chunks) leaves dead
    entries behind; they are compacted away a few entries per insert or update (was: the whole
    array in one call, 10 ms at 1M entries with the GIL and the service's lock held), with
    insertion order, lookups, updates and deletes right in the middle of it, and memory that
    stops growing."""
    t, d = _FAST.LearnedTable(), {}
    live = 5000
    for k in range(live):
        t[k] = d[k] = k
    nxt, mid, sizes = live, 0, []
    for i in range(40_000):
        t[nxt] = d[nxt] = nxt * 7
        nxt += 1
        if i % 500 == 499:  # the map's bound: drop the oldest
            for k in t.oldest(500):
                del t[k]
                del d[k]
        if t.growth_stats()["compacting"] and mid < 3:  # in the middle of a compaction
            mid += 1
            keys = list(d)
            for k in (keys[0], keys[len(keys) // 2], keys[-1]):  # updates keep their place
                t[k] = d[k] = k + 1
            for k in (keys[1], keys[len(keys) // 3], keys[-2]):
                del t[k]
                del d[k]
            assert list(t.items()) == list(d.items())
            assert all(t.get(k) == d.get(k) for k in keys[::97])
        if i >= 20_000:
            sizes.append(t.__sizeof__())
    s = t.growth_stats()
    assert mid == 3 and s["compactions"] >= 4
    assert s["compact_max"] <= 16, "no insert or update looks at more than 16 entries of a compaction"
    assert list(t.items()) == list(d.items())
    assert len(set(sizes)) == 1, "in a steady state the table stops growing"
    # a key the table cannot hold inline, mid-compaction: the table becomes a dict, order kept
    while not t.growth_stats()["compacting"]:
        for k in t.oldest(400):
            del t[k]
            del d[k]
        t[nxt] = d[nxt] = 1
        nxt += 1
    t[b"bytes-key"] = d[b"bytes-key"] = 5
    assert t.is_dict() and list(t.items()) == list(d.items())
