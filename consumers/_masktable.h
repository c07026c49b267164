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

#define MT_NONE ((uint32_t)0xFFFFFFFFu)
#define MT_NOPAR ((uint64_t)0xFFFFFFFFFFFFFFFFULL) /* no parent link */

/* --- open addressing, shared by MaskTable and LearnedTable (_learned.h) ------------------
 * A table of u32 slots, each 0 (empty) or an entry number + 1, probed linearly from a key's
 * home slot; a deletion shifts later entries of the probe run back (no tombstones). */

static inline uint32_t
oa_home(uint64_t k, uint32_t slot_mask)
{
    return (uint32_t)((k * 0x9E3779B97F4A7C15ULL) >> 32) & slot_mask;
}

/* a new, empty slot array of `size` (a power of two), or NULL with MemoryError */
static uint32_t *
oa_new_slots(uint32_t size)
{
    uint32_t *slot = PyMem_RawCalloc(size, sizeof(uint32_t));
    if (slot == NULL)
        PyErr_NoMemory();
    return slot;
}

/* put entry e (key k) in the first free slot of its probe run (rebuilding an index) */
static inline void
oa_place(uint32_t *slot, uint32_t slot_mask, uint64_t k, uint32_t e)
{
    uint32_t i = oa_home(k, slot_mask);
    while (slot[i])
        i = (i + 1) & slot_mask;
    slot[i] = e + 1;
}

/* the key of entry e of `table` (each table says where its keys are) */
typedef uint64_t (*oa_key_fn)(const void *table, uint32_t e);

/* empty slot `pos`, moving back the entries after it whose home allows */
static void
oa_delete(uint32_t *slot, uint32_t slot_mask, uint32_t pos, const void *table, oa_key_fn key_of)
{
    uint32_t i = pos;
    for (;;) {
        slot[i] = 0;
        uint32_t j = i;
        for (;;) {
            j = (j + 1) & slot_mask;
            uint32_t s = slot[j];
            if (s == 0)
                return;
            uint32_t home = oa_home(key_of(table, s - 1), slot_mask);
            /* can the entry at j move to i? only if i lies cyclically in [home, j) */
            if (i <= j ? (home <= i || home > j) : (home <= i && home > j)) {
                slot[i] = s;
                i = j;
                break;
            }
        }
    }
}

typedef struct {
    PyObject_HEAD
    uint32_t W;         /* 64-bit words per mask */
    uint32_t n;         /* live keys */
    uint32_t cap;       /* entries allocated */
    uint32_t used;      /* entries handed out so far (the rest of cap is untouched) */
    uint32_t free_head; /* recycled entries, chained through nxt */
    uint32_t head;      /* oldest */
    uint32_t tail;      /* newest */
    void *raw;          /* the entries' allocation; `base` is it aligned to 64 bytes */
    char *base;         /* cap entries of `stride` bytes (MEnt), one cache line for 4 mask words */
    size_t stride;
    uint32_t *slot;     /* entry + 1; 0 = empty */
    uint32_t slot_mask; /* table size - 1 (a power of two) */
    uint64_t version;   /* bumped by every change */
    long long entries;  /* set bits over every key: the index's (key, endpoint, tier) entries */
} MaskTable;

/* One key's entry: everything a lookup, an LRU move and a bit update touch, together. */
typedef struct {
    uint64_t key;
    uint64_t par;       /* the key's parent key (what index.parents holds), or MT_NOPAR */
    uint32_t prv;       /* LRU links */
    uint32_t nxt;
    uint64_t bits[];    /* W words */
} MEnt;

#define ENT(t, e) ((MEnt *)((t)->base + (size_t)(e) * (t)->stride))

static PyTypeObject MaskTableType;

static inline size_t
mt_stride(uint32_t W)
{
    size_t s = sizeof(MEnt) + (size_t)W * sizeof(uint64_t);
    return (s + 7) & ~(size_t)7;
}

/* a zeroed block of n entries of `stride` bytes, aligned to 64: (raw, base) or -1 */
static int
mt_alloc_entries(size_t n, size_t stride, void **raw, char **base)
{
    void *r = PyMem_RawCalloc(1, n * stride + 64);
    if (r == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *raw = r;
    *base = (char *)(((uintptr_t)r + 63) & ~(uintptr_t)63);
    return 0;
}

static inline uint32_t
mt_home(const MaskTable *t, uint64_t k)
{
    return oa_home(k, t->slot_mask);
}

static uint64_t
mt_key_at(const void *t, uint32_t e)
{
    return ENT((const MaskTable *)t, e)->key;
}

/* entry of k, or MT_NONE; *pos gets the table position where it is (or would go) */
static inline uint32_t
mt_find(const MaskTable *t, uint64_t k, uint32_t *pos)
{
    uint32_t i = mt_home(t, k);
    for (;;) {
        uint32_t s = t->slot[i];
        if (s == 0) {
            if (pos) *pos = i;
            return MT_NONE;
        }
        if (ENT(t, s - 1)->key == k) {
            if (pos) *pos = i;
            return s - 1;
        }
        i = (i + 1) & t->slot_mask;
    }
}

static int
mt_rehash(MaskTable *t, uint32_t size)
{
    uint32_t *slot = oa_new_slots(size);
    if (slot == NULL)
        return -1;
    PyMem_RawFree(t->slot);
    t->slot = slot;
    t->slot_mask = size - 1;
    for (uint32_t e = t->head; e != MT_NONE; e = ENT(t, e)->nxt)
        oa_place(slot, t->slot_mask, ENT(t, e)->key, e);
    return 0;
}

static int
mt_reserve(MaskTable *t)
{
    if ((uint64_t)(t->n + 1) * 2 > (uint64_t)t->slot_mask + 1) {
        if (t->slot_mask >= 0x7FFFFFFFu) {
            PyErr_SetString(PyExc_MemoryError, "router index: too many keys");
            return -1;
        }
        if (mt_rehash(t, (t->slot_mask + 1) * 2) < 0)
            return -1;
    }
    if (t->free_head == MT_NONE && t->used == t->cap) {
        uint64_t ncap = t->cap ? (uint64_t)t->cap * 2 : 64;
        if (ncap >= MT_NONE) {
            PyErr_SetString(PyExc_MemoryError, "router index: too many keys");
            return -1;
        }
        void *raw;
        char *base;
        if (mt_alloc_entries(ncap, t->stride, &raw, &base) < 0)
            return -1;
        if (t->used)
            memcpy(base, t->base, (size_t)t->used * t->stride);
        PyMem_RawFree(t->raw);
        t->raw = raw;
        t->base = base;
        t->cap = (uint32_t)ncap;
    }
    return 0;
}

static inline void
mt_unlink(MaskTable *t, uint32_t e)
{
    uint32_t p = ENT(t, e)->prv, q = ENT(t, e)->nxt;
    if (p == MT_NONE) t->head = q; else ENT(t, p)->nxt = q;
    if (q == MT_NONE) t->tail = p; else ENT(t, q)->prv = p;
}

static inline void
mt_link_tail(MaskTable *t, uint32_t e)
{
    ENT(t, e)->prv = t->tail;
    ENT(t, e)->nxt = MT_NONE;
    if (t->tail == MT_NONE) t->head = e; else ENT(t, t->tail)->nxt = e;
    t->tail = e;
}

/* the entry of k, created (empty mask, newest) if absent; *created tells which. MT_NONE on error */
static uint32_t
mt_get_or_add(MaskTable *t, uint64_t k, int *created)
{
    uint32_t pos;
    uint32_t e = mt_find(t, k, &pos);
    if (e != MT_NONE) {
        *created = 0;
        return e;
    }
    uint32_t before = t->slot_mask;
    if (mt_reserve(t) < 0)
        return MT_NONE;
    if (t->slot_mask != before)
        mt_find(t, k, &pos);
    if (t->free_head != MT_NONE) {
        e = t->free_head;
        t->free_head = ENT(t, e)->nxt;
    } else {
        e = t->used++;
    }
    ENT(t, e)->key = k;
    ENT(t, e)->par = MT_NOPAR;
    memset(ENT(t, e)->bits, 0, t->W * sizeof(uint64_t));
    t->slot[pos] = e + 1;
    mt_link_tail(t, e);
    t->n++;
    t->version++;
    *created = 1;
    return e;
}

/* delete the key at table position pos (backward-shift), entry e */
static void
mt_delete(MaskTable *t, uint32_t pos, uint32_t e)
{
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
    if (parent != MT_NOPAR)
        ENT(t, e)->par = parent;
    if (!created && e != t->tail) {
        mt_unlink(t, e);
        mt_link_tail(t, e);
        t->version++;
    }
    uint64_t *w = ENT(t, e)->bits + (b >> 6);
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

/* --- Python methods --------------------------------------------------------------------- */

static PyObject *
mt_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *names[] = {"bits", NULL};
    Py_ssize_t nbits;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "n:MaskTable", names, &nbits))
        return NULL;
    if (nbits < 1 || nbits > (1 << 20)) {
        PyErr_Format(PyExc_ValueError, "MaskTable: bits must be in [1, 2**20], got %zd", nbits);
        return NULL;
    }
    MaskTable *t = (MaskTable *)type->tp_alloc(type, 0);
    if (t == NULL)
        return NULL;
    t->W = (uint32_t)((nbits + 63) / 64);
    t->stride = mt_stride(t->W);
    t->free_head = t->head = t->tail = MT_NONE;
    t->slot = PyMem_RawCalloc(16, sizeof(uint32_t));
    if (t->slot == NULL) {
        Py_DECREF(t);
        return PyErr_NoMemory();
    }
    t->slot_mask = 15;
    return (PyObject *)t;
}

static void
mt_dealloc(MaskTable *t)
{
    PyMem_RawFree(t->raw);
    PyMem_RawFree(t->slot);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t
mt_len(MaskTable *t)
{
    return t->n;
}

static int
mt_contains(MaskTable *t, PyObject *o)
{
    uint64_t k;
    return mt_key_of(o, &k) && mt_find(t, k, NULL) != MT_NONE;
}

static PyObject *
mt_subscript(MaskTable *t, PyObject *o)
{
    uint64_t k;
    uint32_t e = mt_key_of(o, &k) ? mt_find(t, k, NULL) : MT_NONE;
    if (e == MT_NONE) {
        PyErr_SetObject(PyExc_KeyError, o);
        return NULL;
    }
    return mt_mask_obj(t, e);
}

static PyObject *
mt_get(MaskTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get(key, default=None)");
        return NULL;
    }
    uint64_t k;
    uint32_t e = mt_key_of(args[0], &k) ? mt_find(t, k, NULL) : MT_NONE;
    if (e == MT_NONE) {
        PyObject *d = nargs == 2 ? args[1] : Py_None;
        Py_INCREF(d);
        return d;
    }
    return mt_mask_obj(t, e);
}

/* keys (what=0), values (1) or (key, value) items (2), oldest first */
static PyObject *
mt_list(MaskTable *t, int what)
{
    PyObject *out = PyList_New(t->n);
    if (out == NULL)
        return NULL;
    Py_ssize_t i = 0;
    for (uint32_t e = t->head; e != MT_NONE; e = ENT(t, e)->nxt, i++) {
        PyObject *k = NULL, *v = NULL, *item;
        if (what != 1 && (k = PyLong_FromUnsignedLongLong(ENT(t, e)->key)) == NULL)
            goto fail;
        if (what != 0 && (v = mt_mask_obj(t, e)) == NULL) {
            Py_XDECREF(k);
            goto fail;
        }
        if (what == 2) {
            item = PyTuple_Pack(2, k, v);
            Py_DECREF(k);
            Py_DECREF(v);
            if (item == NULL)
                goto fail;
        } else {
            item = what == 0 ? k : v;
        }
        PyList_SET_ITEM(out, i, item);
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyObject *mt_keys(MaskTable *t, PyObject *unused) { return mt_list(t, 0); }
static PyObject *mt_values(MaskTable *t, PyObject *unused) { return mt_list(t, 1); }
static PyObject *mt_items(MaskTable *t, PyObject *unused) { return mt_list(t, 2); }

static PyObject *
mt_iter(MaskTable *t)
{
    PyObject *keys = mt_list(t, 0);
    if (keys == NULL)
        return NULL;
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

/* (keys, bit) arguments: the keys as a fast sequence (a new reference) and the bit, or NULL */
static PyObject *
mt_keys_and_bit(MaskTable *t, PyObject *args, const char *fmt, const char *what, uint32_t *b)
{
    PyObject *keys, *bo;
    if (!PyArg_ParseTuple(args, fmt, &keys, &bo) || mt_bit_arg(t, bo, b) < 0)
        return NULL;
    return PySequence_Fast(keys, what);
}

static PyObject *
mt_py_set_bit(MaskTable *t, PyObject *args)
{
    uint32_t b;
    PyObject *seq = mt_keys_and_bit(t, args, "OO:set_bit", "set_bit: keys must be a sequence of ints", &b);
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), fresh = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t k;
        if (!mt_key_of(PySequence_Fast_GET_ITEM(seq, i), &k)) {
            Py_DECREF(seq);
            PyErr_SetString(PyExc_ValueError, "set_bit: a key must be an int in [0, 2**64)");
            return NULL;
        }
        int f = mt_set_bit(t, k, b);
        if (f < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        fresh += f;
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(fresh);
}

/* set_chain(keys, bit, parent) -> new entries: keys is a chain (each links to the one before,
 * the first to `parent` unless it is None), as BlockIndex.add_chain */
static PyObject *
mt_py_set_chain(MaskTable *t, PyObject *args)
{
    PyObject *keys, *bo, *po;
    if (!PyArg_ParseTuple(args, "OOO:set_chain", &keys, &bo, &po))
        return NULL;
    uint32_t b;
    if (mt_bit_arg(t, bo, &b) < 0)
        return NULL;
    uint64_t prev = MT_NOPAR;
    if (po != Py_None && !mt_key_of(po, &prev)) {
        PyErr_SetString(PyExc_ValueError, "set_chain: the parent must be None or an int in [0, 2**64 - 1)");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(keys, "set_chain: keys must be a sequence of ints");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), fresh = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t k;
        if (!mt_key_of(PySequence_Fast_GET_ITEM(seq, i), &k) || k == MT_NOPAR) {
            Py_DECREF(seq);
            PyErr_SetString(PyExc_ValueError, "set_chain: a key must be an int in [0, 2**64 - 1)");
            return NULL;
        }
        int f = mt_set_bit_parent(t, k, b, prev);
        if (f < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        fresh += f;
        prev = k;
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(fresh);
}

/* parent(key) -> the parent key or None */
static PyObject *
mt_py_parent(MaskTable *t, PyObject *o)
{
    uint64_t k, p;
    if (!mt_key_of(o, &k) || (p = mt_parent(t, k)) == MT_NOPAR)
        Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(p);
}

/* walk_back(key, n, stop=None) -> up to n keys ending at key, oldest first, stopping before `stop` */
static PyObject *
mt_py_walk_back(MaskTable *t, PyObject *args)
{
    PyObject *ko, *so = Py_None;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "On|O:walk_back", &ko, &n, &so))
        return NULL;
    uint64_t k, stop = MT_NOPAR;
    int has_stop = so != Py_None && mt_key_of(so, &stop);
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    if (PyList_Append(out, ko) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    if (mt_key_of(ko, &k)) {
        while (PyList_GET_SIZE(out) < n) {
            k = mt_parent(t, k);
            if (k == MT_NOPAR || (has_stop && k == stop))
                break;
            PyObject *v = PyLong_FromUnsignedLongLong(k);
            if (v == NULL || PyList_Append(out, v) < 0) {
                Py_XDECREF(v);
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(v);
        }
    }
    if (PyList_Reverse(out) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

/* keys_between(key, stop, limit) -> the keys after `stop` up to and including `key`, oldest
 * first; None if `stop` is not an ancestor within `limit` steps */
static PyObject *
mt_py_keys_between(MaskTable *t, PyObject *args)
{
    PyObject *ko, *so;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "OOn:keys_between", &ko, &so, &limit))
        return NULL;
    uint64_t k, stop;
    if (!mt_key_of(ko, &k) || !mt_key_of(so, &stop))
        Py_RETURN_NONE;
    Py_ssize_t steps = 0;
    uint64_t cur = k;
    for (; steps < limit; steps++) {
        cur = mt_parent(t, cur);
        if (cur == MT_NOPAR)
            Py_RETURN_NONE;
        if (cur == stop)
            break;
    }
    if (steps == limit)
        Py_RETURN_NONE;
    /* steps + 1 keys: key and its `steps` ancestors below stop */
    PyObject *out = PyList_New(steps + 1);
    if (out == NULL)
        return NULL;
    cur = k;
    for (Py_ssize_t i = steps; i >= 0; i--) {
        PyObject *v = PyLong_FromUnsignedLongLong(cur);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, v);
        cur = mt_parent(t, cur);
    }
    return out;
}

/* parents() -> {key: parent} of every linked key, oldest first (introspection, tests) */
static PyObject *
mt_py_parents(MaskTable *t, PyObject *unused)
{
    PyObject *out = PyDict_New();
    if (out == NULL)
        return NULL;
    for (uint32_t e = t->head; e != MT_NONE; e = ENT(t, e)->nxt) {
        if (ENT(t, e)->par == MT_NOPAR)
            continue;
        PyObject *k = PyLong_FromUnsignedLongLong(ENT(t, e)->key);
        PyObject *v = PyLong_FromUnsignedLongLong(ENT(t, e)->par);
        int rc = (k == NULL || v == NULL) ? -1 : PyDict_SetItem(out, k, v);
        Py_XDECREF(k);
        Py_XDECREF(v);
        if (rc < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

static PyObject *
mt_py_clear_bit(MaskTable *t, PyObject *args)
{
    uint32_t b;
    PyObject *seq = mt_keys_and_bit(t, args, "OO:clear_bit", "clear_bit: keys must be a sequence of ints", &b);
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), gone = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t k;
        if (mt_key_of(PySequence_Fast_GET_ITEM(seq, i), &k))
            gone += mt_clear_bit(t, k, b);
    }
    Py_DECREF(seq);
    if (gone)
        t->version++;
    return PyLong_FromSsize_t(gone);
}

/* clear_bits(bit_list) -> entries cleared, over every key (no move) */
static PyObject *
mt_py_clear_bits(MaskTable *t, PyObject *arg)
{
    PyObject *seq = PySequence_Fast(arg, "clear_bits: a sequence of bit numbers");
    if (seq == NULL)
        return NULL;
    Py_ssize_t nb = PySequence_Fast_GET_SIZE(seq);
    uint64_t *clear = PyMem_Calloc(t->W, sizeof(uint64_t));
    if (clear == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < nb; i++) {
        uint32_t b;
        if (mt_bit_arg(t, PySequence_Fast_GET_ITEM(seq, i), &b) < 0) {
            PyMem_Free(clear);
            Py_DECREF(seq);
            return NULL;
        }
        clear[b >> 6] |= (uint64_t)1 << (b & 63);
    }
    Py_DECREF(seq);
    Py_ssize_t gone = 0;
    for (uint32_t e = t->head; e != MT_NONE; e = ENT(t, e)->nxt) {
        uint64_t *w = ENT(t, e)->bits;
        for (uint32_t j = 0; j < t->W; j++) {
            uint64_t hit = w[j] & clear[j];
            if (hit) {
                gone += __builtin_popcountll(hit);
                w[j] &= ~hit;
            }
        }
    }
    PyMem_Free(clear);
    if (gone)
        t->version++;
    t->entries -= gone;
    return PyLong_FromSsize_t(gone);
}

/* evict(target) -> (evicted keys oldest first, entries they held): drop the oldest keys while
 * entries > target or len > target */
static PyObject *
mt_py_evict(MaskTable *t, PyObject *arg)
{
    long long target = PyLong_AsLongLong(arg);
    if (target == -1 && PyErr_Occurred())
        return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    long long dropped = 0;
    while ((t->entries > target || (long long)t->n > target) && t->head != MT_NONE) {
        uint32_t e = t->head;
        PyObject *k = PyLong_FromUnsignedLongLong(ENT(t, e)->key);
        if (k == NULL || PyList_Append(out, k) < 0) {
            Py_XDECREF(k);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(k);
        int c = mt_popcount(ENT(t, e)->bits, t->W);
        t->entries -= c;
        dropped += c;
        uint32_t pos;
        mt_find(t, ENT(t, e)->key, &pos);
        mt_delete(t, pos, e);
    }
    return Py_BuildValue("(NL)", out, dropped);
}

/* grow(old_cap, new_cap, tiers): bit tier*old_cap+slot moves to tier*new_cap+slot */
static PyObject *
mt_py_grow(MaskTable *t, PyObject *args)
{
    unsigned int old_cap, new_cap, tiers;
    if (!PyArg_ParseTuple(args, "III:grow", &old_cap, &new_cap, &tiers))
        return NULL;
    if (new_cap < old_cap || (uint64_t)old_cap * tiers > (uint64_t)t->W * 64 || (uint64_t)new_cap * tiers > (1u << 20)) {
        PyErr_SetString(PyExc_ValueError, "grow: bad layout");
        return NULL;
    }
    uint32_t W2 = (uint32_t)(((uint64_t)new_cap * tiers + 63) / 64);
    size_t stride2 = mt_stride(W2);
    void *raw;
    char *base;
    if (mt_alloc_entries(t->cap ? t->cap : 1, stride2, &raw, &base) < 0)
        return NULL;
    for (uint32_t e = 0; e < t->used; e++) { /* every entry, free ones too (their links matter) */
        const MEnt *o = ENT(t, e);
        MEnt *d = (MEnt *)(base + (size_t)e * stride2);
        d->key = o->key;
        d->par = o->par;
        d->prv = o->prv;
        d->nxt = o->nxt;
        for (uint32_t tier = 0; tier < tiers; tier++)
            for (uint32_t s = 0; s < old_cap; s++) {
                uint32_t b = tier * old_cap + s;
                if (o->bits[b >> 6] >> (b & 63) & 1) {
                    uint32_t nb = tier * new_cap + s;
                    d->bits[nb >> 6] |= (uint64_t)1 << (nb & 63);
                }
            }
    }
    PyMem_RawFree(t->raw);
    t->raw = raw;
    t->base = base;
    t->stride = stride2;
    t->W = W2;
    t->version++;
    Py_RETURN_NONE;
}

static PyObject *
mt_py_nbytes(MaskTable *t, PyObject *unused)
{
    size_t b = sizeof(MaskTable) + (size_t)t->cap * t->stride + (t->raw ? 64 : 0) +
               ((size_t)t->slot_mask + 1) * sizeof(uint32_t);
    return PyLong_FromSize_t(b);
}

static PyObject *
mt_py_bit_count(MaskTable *t, PyObject *unused)
{
    long long c = 0;
    for (uint32_t e = t->head; e != MT_NONE; e = ENT(t, e)->nxt)
        c += mt_popcount(ENT(t, e)->bits, t->W);
    return PyLong_FromLongLong(c);
}

/* lane_counts(cap, tiers) -> [set bits of tier t's lane for t in range(tiers)] */
static PyObject *
mt_py_lane_counts(MaskTable *t, PyObject *args)
{
    unsigned int cap, tiers;
    if (!PyArg_ParseTuple(args, "II:lane_counts", &cap, &tiers))
        return NULL;
    if ((uint64_t)cap * tiers > (uint64_t)t->W * 64) {
        PyErr_SetString(PyExc_ValueError, "lane_counts: layout larger than the table's masks");
        return NULL;
    }
    long long *counts = PyMem_Calloc(tiers ? tiers : 1, sizeof(long long));
    if (counts == NULL)
        return PyErr_NoMemory();
    for (uint32_t e = t->head; e != MT_NONE; e = ENT(t, e)->nxt) {
        const uint64_t *w = ENT(t, e)->bits;
        for (uint32_t j = 0; j < t->W; j++) {
            uint64_t x = w[j];
            while (x) {
                uint32_t b = j * 64 + (uint32_t)__builtin_ctzll(x);
                x &= x - 1;
                if (b / cap < tiers)
                    counts[b / cap]++;
            }
        }
    }
    PyObject *out = PyList_New(tiers);
    for (uint32_t i = 0; out != NULL && i < tiers; i++) {
        PyObject *v = PyLong_FromLongLong(counts[i]);
        if (v == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, v);
    }
    PyMem_Free(counts);
    return out;
}

static PyMethodDef mt_methods[] = {
    {"lane_counts", (PyCFunction)mt_py_lane_counts, METH_VARARGS, "lane_counts(cap, tiers) -> set bits per tier"},
    {"get", (PyCFunction)(void (*)(void))mt_get, METH_FASTCALL, "get(key, default=None): the key's mask (an int)"},
    {"keys", (PyCFunction)mt_keys, METH_NOARGS, "keys, oldest first"},
    {"values", (PyCFunction)mt_values, METH_NOARGS, "masks, oldest key first"},
    {"items", (PyCFunction)mt_items, METH_NOARGS, "(key, mask), oldest first"},
    {"set_bit", (PyCFunction)mt_py_set_bit, METH_VARARGS, "set_bit(keys, bit) -> new entries; moves keys to the newest end"},
    {"set_chain", (PyCFunction)mt_py_set_chain, METH_VARARGS, "set_chain(keys, bit, parent) -> new entries; links the chain"},
    {"parent", (PyCFunction)mt_py_parent, METH_O, "parent(key) -> its parent key or None"},
    {"walk_back", (PyCFunction)mt_py_walk_back, METH_VARARGS, "walk_back(key, n, stop=None) -> keys, oldest first"},
    {"keys_between", (PyCFunction)mt_py_keys_between, METH_VARARGS, "keys_between(key, stop, limit) -> keys or None"},
    {"parents", (PyCFunction)mt_py_parents, METH_NOARGS, "{key: parent} of every linked key"},
    {"clear_bit", (PyCFunction)mt_py_clear_bit, METH_VARARGS, "clear_bit(keys, bit) -> entries cleared"},
    {"clear_bits", (PyCFunction)mt_py_clear_bits, METH_O, "clear_bits(bits) -> entries cleared, over every key"},
    {"evict", (PyCFunction)mt_py_evict, METH_O, "evict(target) -> (keys, entries): oldest keys dropped"},
    {"grow", (PyCFunction)mt_py_grow, METH_VARARGS, "grow(old_cap, new_cap, tiers): re-lay every mask"},
    {"nbytes", (PyCFunction)mt_py_nbytes, METH_NOARGS, "bytes held"},
    {"bit_count", (PyCFunction)mt_py_bit_count, METH_NOARGS, "set bits over every key"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef mt_members[] = {
    {"entries", T_LONGLONG, offsetof(MaskTable, entries), 0, "set bits over every key"},
    {NULL, 0, 0, 0, NULL},
};

static PySequenceMethods mt_as_sequence = {
    .sq_contains = (objobjproc)mt_contains,
};

static PyMappingMethods mt_as_mapping = {
    .mp_length = (lenfunc)mt_len,
    .mp_subscript = (binaryfunc)mt_subscript,
};

static PyTypeObject MaskTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "consumers._fastpath.MaskTable",
    .tp_basicsize = sizeof(MaskTable),
    .tp_dealloc = (destructor)mt_dealloc,
    .tp_as_sequence = &mt_as_sequence,
    .tp_as_mapping = &mt_as_mapping,
    .tp_iter = (getiterfunc)mt_iter,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "key -> endpoint/tier bitmask table of the router index, LRU ordered",
    .tp_methods = mt_methods,
    .tp_members = mt_members,
    .tp_new = mt_new,
};
