/* LearnedTable: the router's engine-hash -> router-key map, in C.
 *
 * Included by _fastpath.c. A mapping with dict semantics (insertion order; assigning to a
 * present key keeps its place; iteration oldest first) for what consumers/index.py's
 * LearnedMap keeps per model: engine block hash -> the router key of that block (an int), or
 * a tuple for an engine block that does not end on a canonical boundary.
 *
 * Keys that are ints in [0, 2**64) — what vLLM sends by default — and int values are stored
 * inline (24-byte entries in insertion order, an open-addressing index of them), so a lookup
 * touches two cache lines instead of a dict's entry plus two int objects. A key of any other
 * kind (bytes hashes, signed ones) turns the table into a plain dict, order kept, for good.
 * Memory comes from PyMem_Raw* (tracemalloc counts it).
 */

/* Needs _oa.h before it; its Python methods and type (_learned_py.h) come after it. */

enum { LT_INT = 0, LT_OBJ = 1, LT_DEAD = 2 };

typedef struct {
    uint64_t key;
    uint64_t val; /* the value (LT_INT) or a PyObject * holding one reference (LT_OBJ) */
    uint32_t tag;
    uint32_t pad;
} LEntry;

typedef struct {
    PyObject_HEAD
    PyObject *dict;     /* non-NULL: dict mode (everything lives there) */
    LEntry *ent;        /* in insertion order, with dead ones until compaction */
    uint32_t used;      /* entries used (live + dead) */
    uint32_t cap;
    uint32_t live;
    uint32_t *slot;     /* entry index + 1; 0 = empty */
    uint32_t slot_mask;
    OaOld old;          /* the previous, smaller index while an incremental rehash runs */
    uint32_t mig_step;  /* old positions moved per insert or update while a rehash runs */
    unsigned long long moved_max; /* most entries one insert or update moved (rehash steps) */
    unsigned long long rehashes;  /* incremental rehashes started */
    /* an incremental compaction under way (comp_on): entries [0, comp_w) are done, [comp_w,
     * comp_r) are dead, [comp_r, used) are still to look at; each insert or update moves the
     * next LT_COMP_STEP entries down (order kept), then used = comp_w */
    uint32_t comp_on;
    uint32_t comp_w, comp_r;
    unsigned long long comp_max;    /* most entries one insert or update looked at (compaction) */
    unsigned long long compactions; /* incremental compactions started */
} LearnedTable;

/* entries a compaction looks at per insert or update: it starts with room for used / 8 more
 * entries and gains 15 per insert, so it ends before the entry array is full */
#define LT_COMP_STEP 16

static PyTypeObject LearnedTableType;

static inline uint32_t
lt_home(const LearnedTable *m, uint64_t k)
{
    return oa_home(k, m->slot_mask);
}

static uint64_t
lt_key_at(const void *m, uint32_t e)
{
    return ((const LearnedTable *)m)->ent[e].key;
}

/* the incremental rehash's two halves for this table (out of line: only while one runs) */
static __attribute__((noinline)) uint32_t
lt_find_old(const LearnedTable *m, uint64_t k, uint32_t *pos)
{
    return oa_find_old(&m->old, k, m, lt_key_at, pos);
}

static __attribute__((noinline)) uint64_t
lt_migrate(LearnedTable *m, uint32_t n)
{
    return oa_migrate(&m->old, m->slot, m->slot_mask, n, m, lt_key_at);
}

/* entry index of k or MT_NONE; *pos: its slot, OA_OLD | its slot in the old index of a rehash
 * under way, or, when absent, where it would go */
static inline uint32_t
lt_find(const LearnedTable *m, uint64_t k, uint32_t *pos)
{
    uint32_t i = lt_home(m, k);
    for (;;) {
        uint32_t s = m->slot[i];
        if (s == 0)
            break;
        if (m->ent[s - 1].key == k) {
            if (pos) *pos = i;
            return s - 1;
        }
        i = (i + 1) & m->slot_mask;
    }
    if (pos) *pos = i;
    if (__builtin_expect(m->old.slot != NULL, 0))
        return lt_find_old(m, k, pos);
    return MT_NONE;
}

/* forget a rehash under way (the index is being rebuilt from the entries, or dropped) */
static void
lt_drop_old(LearnedTable *m)
{
    PyMem_RawFree(m->old.slot);
    m->old.slot = NULL;
    m->old.mask = m->old.next = 0;
}

/* look at the compaction's next n entries: move each live one down to comp_w (its index slot
 * follows it), leave a dead one behind; at the end of the entries, used = comp_w. Returns the
 * entries looked at. */
static uint32_t
lt_compact_step(LearnedTable *m, uint32_t n)
{
    uint32_t done = 0;
    while (m->comp_on && done < n && m->comp_r < m->used) {
        LEntry *x = &m->ent[m->comp_r];
        if (x->tag != LT_DEAD) {
            if (m->comp_w != m->comp_r) {
                uint32_t pos;
                if (lt_find(m, x->key, &pos) == m->comp_r) {
                    if (pos & OA_OLD)
                        m->old.slot[pos & ~OA_OLD] = m->comp_w + 1;
                    else
                        m->slot[pos] = m->comp_w + 1;
                }
                m->ent[m->comp_w] = *x;
                x->tag = LT_DEAD;
            }
            m->comp_w++;
        }
        m->comp_r++;
        done++;
    }
    if (m->comp_on && m->comp_r == m->used) {
        m->used = m->comp_w;
        m->comp_on = 0;
    }
    return done;
}

/* more room in the entry array (doubled), or -1 with MemoryError */
static int
lt_grow_entries(LearnedTable *m)
{
    uint64_t ncap = m->cap ? (uint64_t)m->cap * 2 : 64;
    if (ncap >= MT_NONE) {
        PyErr_SetString(PyExc_MemoryError, "learned table: too many keys");
        return -1;
    }
    LEntry *ent = PyMem_RawRealloc(m->ent, ncap * sizeof(LEntry));
    if (ent == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    m->ent = ent;
    m->cap = (uint32_t)ncap;
    return 0;
}

/* room for one more entry (an index at its load limit starts an incremental rehash; an entry
 * array at least half used, a quarter of it dead, starts an incremental compaction) */
static int
lt_reserve(LearnedTable *m, uint64_t *moved)
{
    if ((uint64_t)(m->live + 1) * 2 > (uint64_t)m->slot_mask + 1) {
        if (m->slot_mask >= 0x7FFFFFFFu) {
            PyErr_SetString(PyExc_MemoryError, "learned table: too many keys");
            return -1;
        }
        if (oa_start_rehash(&m->old, &m->slot, &m->slot_mask, m, lt_key_at, moved) < 0)
            return -1;
        m->rehashes++;
        *moved += lt_migrate(m, m->mig_step);
    }
    if (!m->comp_on && m->used >= m->cap / 2 && (uint64_t)m->live * 4 < (uint64_t)m->used * 3 && m->used >= 64) {
        /* room for used / 8 more entries first, so that the compaction ends before it runs out */
        if (m->cap - m->used < m->used / 8 + 1 && lt_grow_entries(m) < 0)
            return -1;
        m->comp_on = 1;
        m->comp_w = m->comp_r = 0;
        m->compactions++;
    }
    if (m->used == m->cap) {
        if (m->comp_on) { /* not reached (see LT_COMP_STEP); finish it rather than grow */
            lt_compact_step(m, UINT32_MAX);
            if (m->used < m->cap)
                return 0;
        }
        return lt_grow_entries(m);
    }
    return 0;
}

/* set k -> (tag, val); an LT_OBJ val's reference is taken over. 0 ok, -1 error (val released) */
static int
lt_set(LearnedTable *m, uint64_t k, uint32_t tag, uint64_t val)
{
    uint64_t moved = 0;
    if (__builtin_expect(m->old.slot != NULL, 0) &&
        (moved = lt_migrate(m, m->mig_step)) > m->moved_max)
        m->moved_max = moved;
    if (__builtin_expect(m->comp_on, 0)) {
        uint32_t looked = lt_compact_step(m, LT_COMP_STEP);
        if (looked > m->comp_max)
            m->comp_max = looked;
    }
    uint32_t pos;
    uint32_t e = lt_find(m, k, &pos);
    if (e != MT_NONE) {
        LEntry *x = &m->ent[e];
        if (x->tag == LT_OBJ)
            Py_DECREF((PyObject *)(uintptr_t)x->val);
        x->tag = tag;
        x->val = val;
        return 0;
    }
    uint32_t mask = m->slot_mask, used = m->used;
    int rc = lt_reserve(m, &moved);
    if (moved > m->moved_max)
        m->moved_max = moved;
    if (rc < 0) {
        if (tag == LT_OBJ)
            Py_DECREF((PyObject *)(uintptr_t)val);
        return -1;
    }
    if (m->slot_mask != mask || m->used != used)
        lt_find(m, k, &pos);
    e = m->used++;
    m->ent[e].key = k;
    m->ent[e].val = val;
    m->ent[e].tag = tag;
    m->ent[e].pad = 0;
    m->slot[pos] = e + 1;
    m->live++;
    return 0;
}

static void
lt_delete_at(LearnedTable *m, uint32_t pos, uint32_t e)
{
    if (pos & OA_OLD)
        m->old.slot[pos & ~OA_OLD] = OA_TOMB;
    else
        oa_delete(m->slot, m->slot_mask, pos, m, lt_key_at);
    if (m->ent[e].tag == LT_OBJ)
        Py_DECREF((PyObject *)(uintptr_t)m->ent[e].val);
    m->ent[e].tag = LT_DEAD;
    m->live--;
}

/* the table as a dict, for good (a key this table cannot hold inline arrived) */
static int
lt_to_dict(LearnedTable *m)
{
    PyObject *d = PyDict_New();
    if (d == NULL)
        return -1;
    for (uint32_t e = 0; e < m->used; e++) {
        LEntry *x = &m->ent[e];
        if (x->tag == LT_DEAD)
            continue;
        PyObject *k = PyLong_FromUnsignedLongLong(x->key);
        PyObject *v = x->tag == LT_INT ? PyLong_FromUnsignedLongLong(x->val) : (PyObject *)(uintptr_t)x->val;
        if (x->tag == LT_OBJ)
            Py_INCREF(v);
        int rc = (k == NULL || v == NULL) ? -1 : PyDict_SetItem(d, k, v);
        Py_XDECREF(k);
        Py_XDECREF(v);
        if (rc < 0) {
            Py_DECREF(d);
            return -1;
        }
    }
    for (uint32_t e = 0; e < m->used; e++)
        if (m->ent[e].tag == LT_OBJ)
            Py_DECREF((PyObject *)(uintptr_t)m->ent[e].val);
    PyMem_RawFree(m->ent);
    PyMem_RawFree(m->slot);
    lt_drop_old(m);
    m->ent = NULL;
    m->slot = NULL;
    m->used = m->cap = m->live = 0;
    m->comp_on = 0;
    m->slot_mask = 0;
    m->dict = d;
    return 0;
}

/* a Python key as an inline key: 1, or 0 (not an int in [0, 2**64)) */
static inline int
lt_key(PyObject *o, uint64_t *k)
{
    if (!PyLong_CheckExact(o) || _PyLong_Sign(o) < 0)
        return 0;
    *k = AS_U64(o);
    if (*k == (uint64_t)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

/* value -> (tag, val); takes a new reference for LT_OBJ */
static inline void
lt_val(PyObject *v, uint32_t *tag, uint64_t *val)
{
    if (PyLong_CheckExact(v) && _PyLong_Sign(v) >= 0) {
        uint64_t u = AS_U64(v);
        if (!(u == (uint64_t)-1 && PyErr_Occurred())) {
            *tag = LT_INT;
            *val = u;
            return;
        }
        PyErr_Clear();
    }
    Py_INCREF(v);
    *tag = LT_OBJ;
    *val = (uint64_t)(uintptr_t)v;
}

static PyObject *
lt_value_obj(const LEntry *x)
{
    if (x->tag == LT_INT)
        return PyLong_FromUnsignedLongLong(x->val);
    PyObject *v = (PyObject *)(uintptr_t)x->val;
    Py_INCREF(v);
    return v;
}

/* Prefetches for the ingest path, which looks up a few keys at a time: issuing every key's
 * memory loads before using any of them overlaps their cache misses. */
static inline void
lt_prefetch_slot(const LearnedTable *m, uint64_t k)
{
    if (m->dict == NULL)
        __builtin_prefetch(&m->slot[lt_home(m, k)]);
}

static inline void
lt_prefetch_entry(const LearnedTable *m, uint64_t k)
{
    if (m->dict == NULL) {
        uint32_t s = m->slot[lt_home(m, k)];
        if (s)
            __builtin_prefetch(&m->ent[s - 1]);
    }
}

/* C-level lookup for the ingest path: 1 found (*is_int, *u or *obj borrowed), 0 absent, -1 error */
static inline int
lt_lookup(LearnedTable *m, uint64_t k, int *is_int, uint64_t *u, PyObject **obj)
{
    if (m->dict != NULL) {
        PyObject *ko = PyLong_FromUnsignedLongLong(k);
        if (ko == NULL)
            return -1;
        PyObject *v = PyDict_GetItemWithError(m->dict, ko);
        Py_DECREF(ko);
        if (v == NULL)
            return PyErr_Occurred() ? -1 : 0;
        *obj = v;
        *is_int = 0;
        if (PyLong_CheckExact(v) && _PyLong_Sign(v) >= 0) {
            *u = AS_U64(v);
            if (*u == (uint64_t)-1 && PyErr_Occurred())
                PyErr_Clear();
            else
                *is_int = 1;
        }
        return 1;
    }
    uint32_t e = lt_find(m, k, NULL);
    if (e == MT_NONE)
        return 0;
    const LEntry *x = &m->ent[e];
    *is_int = x->tag == LT_INT;
    *u = x->val;
    *obj = x->tag == LT_OBJ ? (PyObject *)(uintptr_t)x->val : NULL;
    return 1;
}

/* C-level set of an int value: 0 ok, -1 error */
static inline int
lt_set_int(LearnedTable *m, uint64_t k, uint64_t v)
{
    if (m->dict != NULL) {
        PyObject *ko = PyLong_FromUnsignedLongLong(k), *vo = PyLong_FromUnsignedLongLong(v);
        int rc = (ko == NULL || vo == NULL) ? -1 : PyDict_SetItem(m->dict, ko, vo);
        Py_XDECREF(ko);
        Py_XDECREF(vo);
        return rc;
    }
    return lt_set(m, k, LT_INT, v);
}

static Py_ssize_t
lt_len(LearnedTable *m)
{
    return m->dict != NULL ? PyDict_GET_SIZE(m->dict) : (Py_ssize_t)m->live;
}
