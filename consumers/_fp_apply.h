/* _fp_apply.h: applying parsed events to the learned table and the mask table.
 * Included by _fastpath.c (one extension module, one translation unit). */
/* ------------------------------------------------------------------ applying */

typedef struct {
    /* from the context */
    PyObject *seed, *odd, *tier_names, *bits, *store_chunk, *remove_one;
    LearnedTable *lmap;
    MaskTable *table;
    uint64_t seed_u;
    Py_ssize_t n_tiers;
    int64_t C;
    int64_t block_size, block_size0;
    uint64_t token_tiers, token_tiers0;
    int64_t max_entries, low_water;
    /* tallies */
    Py_ssize_t events, blocks_stored, offload_blocks, blocks_removed, remove_unknown, ignored;
    long long evicted_keys, evicted_entries;
} Ctx;

/* The tally: an int64 buffer (array('q')) the NativeIngestor owns and folds into its
 * RouterStats; the C path only ever adds to it. T_ROOM is written by Python: how many more
 * learned hashes fit before the LearnedMap must evict. */
enum { T_BATCHES, T_EVENTS, T_STORED, T_OFFLOAD, T_REMOVED, T_UNKNOWN, T_IGNORED, T_LEARNED, T_ROOM,
       T_EVICTED_KEYS, T_EVICTED_ENTRIES, T_N };

static int
tier_of(Ctx *c, const uint8_t *medium, size_t len)
{
    if (medium == NULL) {
        medium = (const uint8_t *)"GPU";
        len = 3;
    }
    for (Py_ssize_t t = 0; t < c->n_tiers; t++) {
        Py_ssize_t n;
        const char *name = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(c->tier_names, t), &n);
        if (name != NULL && (size_t)n == len && memcmp(name, medium, len) == 0)
            return (int)t;
    }
    PyErr_Clear();
    return -1;
}

#define SLOW 1
#define ERR -1

static int
bookkeeping_due(Ctx *c)
{
    return c->table->entries > c->max_entries || (int64_t)c->table->n > c->max_entries;
}

static inline uint32_t
bit_of(Ctx *c, int tier)
{
    return (uint32_t)PyLong_AsUnsignedLong(PyTuple_GET_ITEM(c->bits, tier));
}

/* the event's hashes as u64 into out (all non-negative ints, else 0: Python decides) */
static int
hashes_u64(const Ev *ev, uint64_t *out)
{
    const uint8_t *hp = ev->hashes;
    for (uint32_t i = 0; i < ev->n_hashes; i++) {
        Rd r = {hp, hp + 9};
        uint64_t u = 0;
        int64_t sv = 0;
        if (rd_int(&r, &u, &sv) != 1)
            return 0; /* a signed hash: keyed differently in Python, which decides */
        hp = r.p;
        out[i] = u;
    }
    return 1;
}

#define U64_STACK 64

/* overlap the cache misses of n lookups: every slot line first, then every entry line */
static void
prefetch_learned(const LearnedTable *m, const uint64_t *k, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        lt_prefetch_slot(m, k[i]);
    for (Py_ssize_t i = 0; i < n; i++)
        lt_prefetch_entry(m, k[i]);
}

static void
prefetch_masks(const MaskTable *t, const uint64_t *k, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        mt_prefetch_slot(t, k[i]);
    for (Py_ssize_t i = 0; i < n; i++)
        mt_prefetch_entry(t, k[i]);
}

static int
apply_stored_gpu(Ctx *c, Ev *ev, int tier)
{
    Py_ssize_t n = ev->n_hashes;
    uint64_t pv;
    int is_int;
    uint64_t u;
    PyObject *obj;
    if (ev->parent_kind == 0) {
        if (ev->lora)
            return SLOW;
        pv = c->seed_u;
    } else {
        if (ev->parent_kind != 1)
            return SLOW;
        int f = lt_lookup(c->lmap, ev->parent_u, &is_int, &u, &obj);
        if (f < 0)
            return ERR;
        if (f == 0 || !is_int)
            return SLOW; /* orphan or a partial-block parent: the Python path */
        pv = u;
    }
    uint64_t stack[2 * U64_STACK];
    uint64_t *hs = n <= U64_STACK ? stack : PyMem_Malloc(sizeof(uint64_t) * 2 * (size_t)n);
    if (hs == NULL) {
        PyErr_NoMemory();
        return ERR;
    }
    uint64_t *ks = hs + (n <= U64_STACK ? U64_STACK : n);
    int rc = ERR;
    if (!hashes_u64(ev, hs)) {
        rc = SLOW;
        goto out;
    }
    prefetch_learned(c->lmap, hs, n);
    /* already learned (e.g. from another pod): take the keys, no hashing */
    int learned = 0;
    int f = lt_lookup(c->lmap, hs[0], &is_int, &u, &obj);
    if (f < 0)
        goto out;
    if (f == 1) {
        learned = 1;
        for (Py_ssize_t i = 0; i < n; i++) {
            f = lt_lookup(c->lmap, hs[i], &is_int, &u, &obj);
            if (f < 0)
                goto out;
            if (f == 0 || !is_int) {
                learned = 0;
                break;
            }
            ks[i] = u;
        }
    }
    if (!learned) {
        uint64_t k = pv;
        const uint8_t *tp = ev->toks;
        int64_t C = c->C;
        for (Py_ssize_t b = 0; b < n; b++) {
            uint64_t acc = XXP5;
            for (int64_t j = 0; j < C; j++) {
                Rd r = {tp, tp + 9};
                uint64_t tu = 0;
                int64_t ts = 0;
                int kind = rd_int(&r, &tu, &ts);
                tp = r.p;
                acc = lane_mix(acc, kind == 1 ? int_hash_u(tu) : int_hash_s(ts));
            }
            k = chain_step(k, tuple_end(acc, (uint64_t)C));
            ks[b] = k;
        }
        for (Py_ssize_t i = 0; i < n; i++)
            if (lt_set_int(c->lmap, hs[i], ks[i]) < 0)
                goto out;
    }
    c->block_size = c->C;
    c->token_tiers |= (uint64_t)1 << tier;
    c->blocks_stored += n;
    /* index.add_chain(keys, bit, None if no parent else pv) */
    uint32_t bit = bit_of(c, tier);
    prefetch_masks(c->table, ks, n);
    uint64_t prev = ev->parent_kind != 0 ? pv : MT_NOPAR;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (mt_set_bit_parent(c->table, ks[i], bit, prev) < 0)
            goto out;
        prev = ks[i];
    }
    rc = 0;
out:
    if (hs != stack)
        PyMem_Free(hs);
    return rc;
}

static int
apply_stored_offload(Ctx *c, Ev *ev, int tier)
{
    Py_ssize_t n = ev->n_hashes;
    long chunk = PyLong_AsLong(PyTuple_GET_ITEM(c->store_chunk, tier));
    /* 0: one key per hash; 1: one key per hash if the event has at most one hash (else the
     * chunk length is inferred in Python); 2: Python */
    if (chunk == 2 || (chunk == 1 && n > 1))
        return SLOW;
    if (c->block_size != c->C || PyObject_IsTrue(PyList_GET_ITEM(c->odd, 0)))
        return SLOW;
    uint64_t stack[U64_STACK];
    uint64_t *ks = n <= U64_STACK ? stack : PyMem_Malloc(sizeof(uint64_t) * (size_t)n);
    if (ks == NULL) {
        PyErr_NoMemory();
        return ERR;
    }
    int rc = ERR;
    if (!hashes_u64(ev, ks)) {
        rc = SLOW;
        goto out;
    }
    prefetch_learned(c->lmap, ks, n);
    for (Py_ssize_t i = 0; i < n; i++) {
        int is_int;
        uint64_t u;
        PyObject *obj;
        int f = lt_lookup(c->lmap, ks[i], &is_int, &u, &obj);
        if (f < 0)
            goto out;
        if (f == 0 || !is_int) {
            rc = SLOW; /* not joinable yet (held by the Python path), or a partial block */
            goto out;
        }
        ks[i] = u;
    }
    c->offload_blocks += n;
    uint32_t bit = bit_of(c, tier);
    prefetch_masks(c->table, ks, n);
    for (Py_ssize_t i = 0; i < n; i++)
        if (mt_set_bit(c->table, ks[i], bit) < 0)
            goto out;
    rc = 0;
out:
    if (ks != stack)
        PyMem_Free(ks);
    return rc;
}

static int
apply_removed(Ctx *c, Ev *ev, int tier)
{
    /* one key per hash: a token tier with engine blocks no larger than a canonical block, or an
     * offload tier whose chunks are one key; anything else in Python */
    int token_tier = (c->token_tiers >> tier) & 1 || (tier == 0 && c->token_tiers == 0);
    if (c->block_size / c->C > 1)
        return SLOW;
    if (!token_tier && !PyObject_IsTrue(PyTuple_GET_ITEM(c->remove_one, tier)))
        return SLOW;
    Py_ssize_t n = ev->n_hashes;
    uint64_t stack[U64_STACK];
    int8_t known_stack[U64_STACK];
    uint64_t *ks = n <= U64_STACK ? stack : PyMem_Malloc(sizeof(uint64_t) * (size_t)n);
    int8_t *known = n <= U64_STACK ? known_stack : PyMem_Malloc((size_t)n);
    int rc = ERR;
    if (ks == NULL || known == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    if (!hashes_u64(ev, ks)) {
        rc = SLOW;
        goto out;
    }
    prefetch_learned(c->lmap, ks, n);
    /* check first: every learned value must be a plain key */
    for (Py_ssize_t i = 0; i < n; i++) {
        int is_int = 0;
        uint64_t u = 0;
        PyObject *obj;
        int f = lt_lookup(c->lmap, ks[i], &is_int, &u, &obj);
        if (f < 0)
            goto out;
        known[i] = (int8_t)f;
        if (f == 1 && !is_int) {
            rc = SLOW;
            goto out;
        }
        ks[i] = u;
    }
    uint32_t bit = bit_of(c, tier);
    int gone = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!known[i]) {
            c->remove_unknown++;
            continue;
        }
        c->blocks_removed++;
        gone += mt_clear_bit(c->table, ks[i], bit);
    }
    if (gone)
        c->table->version++;
    rc = 0;
out:
    if (ks != NULL && ks != stack)
        PyMem_Free(ks);
    if (known != NULL && known != known_stack)
        PyMem_Free(known);
    return rc;
}

/* The endpoint's context, a tuple made by NativeIngestor._context:
 * (stamp, lmap, table, seed, C, odd, block_size, token_tiers, tier_names, bits,
 *  store_chunk, remove_one, max_entries, low_water) */
#define CTX_LEN 14

static int
ctx_from(PyObject *t, Ctx *c)
{
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != CTX_LEN) {
        PyErr_SetString(PyExc_TypeError, "fastpath context: a 14-tuple expected");
        return -1;
    }
    memset(c, 0, sizeof(*c));
    PyObject *lmap = PyTuple_GET_ITEM(t, 1);
    PyObject *table = PyTuple_GET_ITEM(t, 2);
    c->seed = PyTuple_GET_ITEM(t, 3);
    c->C = PyLong_AsLongLong(PyTuple_GET_ITEM(t, 4));
    c->odd = PyTuple_GET_ITEM(t, 5);
    c->block_size = c->block_size0 = PyLong_AsLongLong(PyTuple_GET_ITEM(t, 6));
    c->token_tiers = c->token_tiers0 = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(t, 7));
    c->tier_names = PyTuple_GET_ITEM(t, 8);
    c->bits = PyTuple_GET_ITEM(t, 9);
    c->store_chunk = PyTuple_GET_ITEM(t, 10);
    c->remove_one = PyTuple_GET_ITEM(t, 11);
    c->max_entries = PyLong_AsLongLong(PyTuple_GET_ITEM(t, 12));
    c->low_water = PyLong_AsLongLong(PyTuple_GET_ITEM(t, 13));
    if (PyErr_Occurred())
        return -1;
    if (!PyObject_TypeCheck(lmap, &LearnedTableType) || !PyObject_TypeCheck(table, &MaskTableType) ||
        !PyLong_CheckExact(c->seed) || !PyList_Check(c->odd) ||
        PyList_GET_SIZE(c->odd) < 1 || !PyTuple_Check(c->tier_names) || !PyTuple_Check(c->bits) ||
        !PyTuple_Check(c->store_chunk) || !PyTuple_Check(c->remove_one) || c->C <= 0) {
        PyErr_SetString(PyExc_TypeError, "fastpath context: wrong types");
        return -1;
    }
    c->table = (MaskTable *)table;
    c->lmap = (LearnedTable *)lmap;
    c->seed_u = AS_U64(c->seed);
    if (c->seed_u == (uint64_t)-1 && PyErr_Occurred())
        return -1;
    c->n_tiers = PyTuple_GET_SIZE(c->tier_names);
    if (PyTuple_GET_SIZE(c->bits) != c->n_tiers || PyTuple_GET_SIZE(c->store_chunk) != c->n_tiers ||
        PyTuple_GET_SIZE(c->remove_one) != c->n_tiers || c->n_tiers > 63) {
        PyErr_SetString(PyExc_TypeError, "fastpath context: per-tier tuples of unequal length");
        return -1;
    }
    for (Py_ssize_t i = 0; i < c->n_tiers; i++) {
        long b = PyLong_AsLong(PyTuple_GET_ITEM(c->bits, i));
        if (b < 0 || (uint64_t)b >= (uint64_t)c->table->W * 64) {
            PyErr_Clear();
            PyErr_SetString(PyExc_ValueError, "fastpath context: a tier bit outside the table");
            return -1;
        }
    }
    return 0;
}

/* Add what was done to the tally; returns None when the caller has nothing left to do (the
 * whole batch applied, the endpoint unchanged, the learned map within its budget), else the
 * result (status, next event, block size, token-tier mask, rank, events left, rest_from,
 * rest_to): with status 1 the events left start at byte rest_from of the payload and end
 * before byte rest_to (the caller decodes only those). */
static PyObject *
finish(int status, int64_t next, Ctx *c, Py_ssize_t learned, int64_t *tally, long long rank, int64_t left,
       Py_ssize_t rest_from, Py_ssize_t rest_to)
{
    tally[T_BATCHES] += 1;
    tally[T_EVENTS] += c->events;
    tally[T_STORED] += c->blocks_stored;
    tally[T_OFFLOAD] += c->offload_blocks;
    tally[T_REMOVED] += c->blocks_removed;
    tally[T_UNKNOWN] += c->remove_unknown;
    tally[T_IGNORED] += c->ignored;
    tally[T_LEARNED] += learned;
    tally[T_EVICTED_KEYS] += c->evicted_keys;
    tally[T_EVICTED_ENTRIES] += c->evicted_entries;
    int changed = c->block_size != c->block_size0 || c->token_tiers != c->token_tiers0;
    int over = tally[T_LEARNED] > tally[T_ROOM];
    if (status == 0 && !changed && !over)
        Py_RETURN_NONE;
    return Py_BuildValue("(iLLKLLnn)", status == 0 && over ? 2 : status, (long long)next,
                         (long long)c->block_size, (unsigned long long)c->token_tiers, rank, (long long)left,
                         rest_from, rest_to);
}

#define MAX_EVENTS_ON_STACK 64
#define PREFETCH_MAX 1024

/* The index is memory-bound: each engine hash costs a few cache misses (learned-table slot and
 * entry, mask-table slot and entry), and done one after the other they add up. Before applying
 * a batch, walk its hashes in passes that only read and prefetch — learned slots, learned
 * entries, then (looking the keys up) mask slots, then mask entries — so each kind of miss is in
 * flight for every hash of the batch at once. Read-only: the apply loop after it decides. */
static void
prefetch_batch(Ctx *c, const Ev *evs, int64_t from, int64_t nev)
{
    uint64_t hs[PREFETCH_MAX];
    int n = 0;
    for (int64_t j = from; j < nev && n < PREFETCH_MAX; j++) {
        const uint8_t *hp = evs[j].hashes;
        for (uint32_t h = 0; h < evs[j].n_hashes && n < PREFETCH_MAX; h++) {
            Rd r = {hp, hp + 9};
            uint64_t u = 0;
            int64_t sv = 0;
            if (rd_int(&r, &u, &sv) != 1)
                break;
            hp = r.p;
            hs[n++] = u;
        }
    }
    for (int k = 0; k < n; k++)
        lt_prefetch_slot(c->lmap, hs[k]);
    for (int k = 0; k < n; k++)
        lt_prefetch_entry(c->lmap, hs[k]);
    for (int k = 0; k < n; k++) {
        uint32_t e = lt_find(c->lmap, hs[k], NULL);
        hs[k] = e != MT_NONE && c->lmap->ent[e].tag == LT_INT ? c->lmap->ent[e].val : MT_NOPAR;
        if (hs[k] != MT_NOPAR)
            mt_prefetch_slot(c->table, hs[k]);
    }
    for (int k = 0; k < n; k++)
        if (hs[k] != MT_NOPAR)
            mt_prefetch_entry(c->table, hs[k]);
}
