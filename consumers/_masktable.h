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

/* An incremental rehash (MaskTable and LearnedTable): the table being drained into a new one
 * twice its size. The new one takes every insert; each insert or update moves the old one's
 * next `step` positions over; a lookup that misses the new one looks in the old one. A moved
 * or deleted old position becomes OA_TOMB (lookups probe past it, so probe runs stay whole).
 * With step >= 2 the old table is empty before the new one reaches its load limit (1/2). */
#define OA_TOMB ((uint32_t)0xFFFFFFFFu) /* old-table slot: moved or deleted (never entry + 1) */
#define OA_OLD ((uint32_t)0x80000000u)  /* a position in the old table (tables hold <= 2**31 slots) */
#define OA_STEP 16                      /* old positions moved per insert or update, by default */

typedef struct {
    uint32_t *slot; /* NULL: no rehash under way */
    uint32_t mask;
    uint32_t next;  /* the next position to move */
} OaOld;

/* the old table's half of a lookup: the entry of k (*pos = OA_OLD | position), or MT_NONE.
 * Inlined into each table's lookup, so key_of is a direct, inlined access. */
static inline __attribute__((always_inline)) uint32_t
oa_find_old(const OaOld *o, uint64_t k, const void *table, oa_key_fn key_of, uint32_t *pos)
{
    const uint32_t *old = o->slot, mask = o->mask;
    uint32_t i = oa_home(k, mask);
    for (;;) {
        uint32_t s = old[i];
        if (s == 0)
            return MT_NONE;
        if (s != OA_TOMB && key_of(table, s - 1) == k) {
            if (pos) *pos = OA_OLD | i;
            return s - 1;
        }
        i = (i + 1) & mask;
    }
}

/* move the old table's next n positions (every one for n = 0) into slot[]; the old table is
 * freed when it is empty. Entries moved. (Inlined per table, like oa_find_old.) */
static inline __attribute__((always_inline)) uint64_t
oa_migrate(OaOld *o, uint32_t *slot, uint32_t slot_mask, uint32_t n, const void *table, oa_key_fn key_of)
{
    uint32_t *old = o->slot;
    if (old == NULL)
        return 0;
    uint64_t moved = 0;
    uint32_t i = o->next, size = o->mask + 1;
    uint32_t stop = n && size - i > n ? i + n : size;
    for (; i < stop; i++) {
        uint32_t s = old[i];
        if ((uint32_t)(s - 1) < OA_TOMB - 1) { /* neither empty nor a tombstone */
            oa_place(slot, slot_mask, key_of(table, s - 1), s - 1);
            old[i] = OA_TOMB;
            moved++;
        }
    }
    o->next = i;
    if (i == size) {
        PyMem_RawFree(old);
        o->slot = NULL;
        o->mask = o->next = 0;
    }
    return moved;
}

/* start draining (*slot, *slot_mask) into a new table twice its size (after finishing a
 * drain still under way: never with step >= 2). 0, or -1 with MemoryError */
static int
oa_start_rehash(OaOld *o, uint32_t **slot, uint32_t *slot_mask, const void *table, oa_key_fn key_of,
                uint64_t *moved)
{
    uint32_t *fresh = oa_new_slots((*slot_mask + 1) * 2);
    if (fresh == NULL)
        return -1;
    *moved += oa_migrate(o, *slot, *slot_mask, 0, table, key_of);
    o->slot = *slot;
    o->mask = *slot_mask;
    o->next = 0;
    *slot = fresh;
    *slot_mask = *slot_mask * 2 + 1;
    return 0;
}

typedef struct {
    PyObject_HEAD
    uint32_t W;         /* 64-bit words per mask */
    uint32_t n;         /* live keys */
    uint32_t cap;       /* entries allocated (over every segment) */
    uint32_t used;      /* entries handed out so far (the rest of cap is untouched) */
    uint32_t free_head; /* recycled entries, chained through nxt */
    uint32_t head;      /* oldest */
    uint32_t tail;      /* newest */
    uint32_t seg_shift; /* entries live in segments of 1 << seg_shift entries (see mt_seg_shift) */
    uint32_t seg_mask;  /* (1 << seg_shift) - 1 */
    char **seg;         /* the segments, each aligned to 64 bytes; segment 0 grows to full size */
    void **seg_raw;     /* their allocations */
    uint32_t nseg;      /* segments in use */
    uint32_t seg_room;  /* pointers the two arrays above have room for */
    size_t stride;
    uint32_t *slot;     /* entry + 1; 0 = empty */
    uint32_t slot_mask; /* table size - 1 (a power of two) */
    OaOld old;          /* the previous, smaller table while an incremental rehash runs */
    uint32_t mig_step;  /* old positions moved per insert or update while a rehash runs */
    uint64_t version;   /* bumped by every change */
    long long entries;  /* set bits over every key: the index's (key, endpoint, tier) entries */
    unsigned long long moved_max;   /* most entries one operation moved (rehash + segment copy) */
    unsigned long long moved_total; /* entries moved by growth, over the table's life */
    unsigned long long rehashes;    /* incremental rehashes started */
} MaskTable;

/* One key's entry: everything a lookup, an LRU move and a bit update touch, together. */
typedef struct {
    uint64_t key;
    uint64_t par;       /* the key's parent key (what index.parents holds), or MT_NOPAR */
    uint32_t prv;       /* LRU links */
    uint32_t nxt;
    uint64_t bits[];    /* W words */
} MEnt;

/* Growth never stops the world: entries live in fixed-size segments (a new one is added when
 * the last is full; only segment 0 grows by copying, up to one segment), so an entry never
 * moves once its segment is full; the slot table doubles incrementally (OaOld above). */
#define MT_SEG_BYTES ((size_t)256 << 10) /* a full segment's size, about */

#define ENT(t, e) \
    ((MEnt *)((t)->seg[(uint32_t)(e) >> (t)->seg_shift] + \
              (size_t)((uint32_t)(e) & (t)->seg_mask) * (t)->stride))

static PyTypeObject MaskTableType;

static inline size_t
mt_stride(uint32_t W)
{
    size_t s = sizeof(MEnt) + (size_t)W * sizeof(uint64_t);
    return (s + 7) & ~(size_t)7;
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

/* the incremental rehash's two halves for this table (out of line: only while one runs) */
static __attribute__((noinline)) uint32_t
mt_find_old(const MaskTable *t, uint64_t k, uint32_t *pos)
{
    return oa_find_old(&t->old, k, t, mt_key_at, pos);
}

static __attribute__((noinline)) uint64_t
mt_migrate(MaskTable *t, uint32_t n)
{
    return oa_migrate(&t->old, t->slot, t->slot_mask, n, t, mt_key_at);
}

#include "_masktable_grow.h"

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

#include "_masktable_map.h"
#include "_masktable_ops.h"
