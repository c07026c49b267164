/* MaskTable: the router index's key -> (endpoint, tier) bitmask table, in C.
 *
 * Included by _fastpath.c (one extension module). What consumers/index.py keeps in a dict of
 * interned Python ints (``masks``), kept here as fixed-width bit words per key:
 *
 *   - entries in struct-of-arrays form: key (u64), W mask words, LRU links (u32 prev/next);
 *   - an open-addressing table (linear probing, backward-shift deletion, load <= 1/2) of
 *     entry numbers + 1;
 *   - the LRU order is the insertion order of a dict whose stored keys are popped and set
 *     again: setting a bit moves the key to the newest end, clearing one does not.
 *
 * Python sees a read-mostly mapping (get, [], in, len, iteration oldest first, keys, values,
 * items) whose values are Python ints equal to the dict's masks, plus the index operations
 * (set_bit, clear_bit, clear_bits, evict, grow) that consumers/index.py's NativeBlockIndex
 * calls. All memory comes from PyMem_Raw* so tracemalloc counts it.
 */

/* Needs _masktable_core.h and _masktable_grow.h before it; its Python mapping interface
 * (_masktable_map.h) and index operations and type (_masktable_ops.h) come after it. */

/* entry of k, or MT_NONE; *pos gets the position where it is, OA_OLD | position when that is
 * in the old table of a rehash under way, or, when absent, where it would go */
static inline uint32_t
mt_find(const MaskTable *t, uint64_t k, uint32_t *pos)
{
    uint32_t i = mt_home(t, k);
    for (;;) {
        uint32_t s = t->slot[i];
        if (s == 0)
            break;
        if (ENT(t, s - 1)->key == k) {
            if (pos) *pos = i;
            return s - 1;
        }
        i = (i + 1) & t->slot_mask;
    }
    if (pos) *pos = i;
    if (__builtin_expect(t->old.slot != NULL, 0))
        return mt_find_old(t, k, pos);
    return MT_NONE;
}

static inline void
mt_unlink(MaskTable *t, uint32_t e)
{
    const MEnt *x = ENT(t, e); /* each entry's address once: it takes a segment lookup */
    uint32_t p = x->prv, q = x->nxt;
    if (p == MT_NONE) t->head = q; else ENT(t, p)->nxt = q;
    if (q == MT_NONE) t->tail = p; else ENT(t, q)->prv = p;
}

static inline void
mt_link_tail(MaskTable *t, uint32_t e)
{
    MEnt *x = ENT(t, e);
    x->prv = t->tail;
    x->nxt = MT_NONE;
    if (t->tail == MT_NONE) t->head = e; else ENT(t, t->tail)->nxt = e;
    t->tail = e;
}

/* the entry of k, created (empty mask, newest) if absent; *created tells which. MT_NONE on error.
 * While a rehash runs, every call moves the next mig_step positions of the old table. */
static uint32_t
mt_get_or_add(MaskTable *t, uint64_t k, int *created)
{
    uint64_t moved = 0;
    if (__builtin_expect(t->old.slot != NULL, 0))
        moved = mt_migrate(t, t->mig_step);
    uint32_t pos;
    uint32_t e = mt_find(t, k, &pos);
    if (e != MT_NONE) {
        *created = 0;
        mt_count_moved(t, moved);
        return e;
    }
    int changed = mt_reserve(t, &moved);
    mt_count_moved(t, moved);
    if (changed < 0)
        return MT_NONE;
    if (changed)
        mt_find(t, k, &pos);
    if (t->free_head != MT_NONE) {
        e = t->free_head;
        t->free_head = ENT(t, e)->nxt;
    } else {
        e = t->used++;
    }
    MEnt *x = ENT(t, e);
    x->key = k;
    x->par = MT_NOPAR;
    memset(x->bits, 0, t->W * sizeof(uint64_t));
    t->slot[pos] = e + 1;
    mt_link_tail(t, e);
    t->n++;
    t->version++;
    *created = 1;
    return e;
}

/* delete the key at position pos (as mt_find gives it), entry e: a backward shift in the
 * current table, a tombstone in the old one */
static void
mt_delete(MaskTable *t, uint32_t pos, uint32_t e)
{
    if (pos & OA_OLD)
        t->old.slot[pos & ~OA_OLD] = OA_TOMB;
    else
        oa_delete(t->slot, t->slot_mask, pos, t, mt_key_at);
    mt_unlink(t, e);
    ENT(t, e)->nxt = t->free_head;
    t->free_head = e;
    t->n--;
    t->version++;
}

static inline int
mt_popcount(const uint64_t *w, uint32_t W)
{
    int c = 0;
    for (uint32_t i = 0; i < W; i++)
        c += __builtin_popcountll(w[i]);
    return c;
}

/* set bit b of k's mask, moving k to the newest end, and link k to `parent` unless that is
 * MT_NOPAR: 1 if the bit is new, 0 if it was set, -1 error */
static int
mt_set_bit_parent(MaskTable *t, uint64_t k, uint32_t b, uint64_t parent)
{
    int created;
    uint32_t e = mt_get_or_add(t, k, &created);
    if (e == MT_NONE)
        return -1;
    MEnt *x = ENT(t, e);
    if (parent != MT_NOPAR)
        x->par = parent;
    if (!created && e != t->tail) {
        mt_unlink(t, e);
        mt_link_tail(t, e);
        t->version++;
    }
    uint64_t *w = x->bits + (b >> 6);
    uint64_t m = (uint64_t)1 << (b & 63);
    if (*w & m)
        return 0;
    *w |= m;
    t->entries++;
    return 1;
}

static inline void
mt_prefetch_slot(const MaskTable *t, uint64_t k)
{
    __builtin_prefetch(&t->slot[mt_home(t, k)]);
}

static inline void
mt_prefetch_entry(const MaskTable *t, uint64_t k)
{
    uint32_t s = t->slot[mt_home(t, k)];
    if (s)
        __builtin_prefetch(ENT(t, s - 1), 1);
}

static inline int
mt_set_bit(MaskTable *t, uint64_t k, uint32_t b)
{
    return mt_set_bit_parent(t, k, b, MT_NOPAR);
}

/* the parent key of k, or MT_NOPAR (no key, or no link) */
static inline uint64_t
mt_parent(const MaskTable *t, uint64_t k)
{
    uint32_t e = mt_find(t, k, NULL);
    return e == MT_NONE ? MT_NOPAR : ENT(t, e)->par;
}

/* clear bit b of k's mask (no move): 1 if it was set */
static int
mt_clear_bit(MaskTable *t, uint64_t k, uint32_t b)
{
    uint32_t e = mt_find(t, k, NULL);
    if (e == MT_NONE)
        return 0;
    uint64_t *w = ENT(t, e)->bits + (b >> 6);
    uint64_t m = (uint64_t)1 << (b & 63);
    if (!(*w & m))
        return 0;
    *w &= ~m;
    t->entries--;
    return 1;
}

static PyObject *
mt_mask_obj(const MaskTable *t, uint32_t e)
{
    const uint64_t *w = ENT(t, e)->bits;
    uint32_t top = t->W;
    while (top > 1 && w[top - 1] == 0)
        top--;
    if (top == 1)
        return PyLong_FromUnsignedLongLong(w[0]);
#if PY_VERSION_HEX >= 0x030D0000
    return PyLong_FromUnsignedNativeBytes(w, top * sizeof(uint64_t), Py_ASNATIVEBYTES_LITTLE_ENDIAN);
#else
    return _PyLong_FromByteArray((const unsigned char *)w, top * sizeof(uint64_t), 1, 0);
#endif
}

/* a Python int key as u64; 0 if it cannot be a key (negative, too big, not an int) */
static inline int
mt_key_of(PyObject *o, uint64_t *k)
{
    if (!PyLong_Check(o))
        return 0;
    *k = AS_U64(o);
    if (*k == (uint64_t)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

static int
mt_bit_arg(MaskTable *t, PyObject *o, uint32_t *b)
{
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < 0 || (uint64_t)v >= (uint64_t)t->W * 64) {
        PyErr_Format(PyExc_ValueError, "bit %ld out of range [0, %u)", v, t->W * 64);
        return -1;
    }
    *b = (uint32_t)v;
    return 0;
}

/* One keys()/values()/items() entry of a C table (the mask table and the learned table share
 * it): `what` 0 keys, 1 values, 2 pairs; k and v are new references (NULL where `what` needs
 * none) and are consumed. A new reference, or NULL with an exception set. */
static inline PyObject *
map_item(int what, PyObject *k, PyObject *v)
{
    if (what != 2)
        return what == 0 ? k : v;
    PyObject *item = PyTuple_Pack(2, k, v);
    Py_DECREF(k);
    Py_DECREF(v);
    return item;
}
