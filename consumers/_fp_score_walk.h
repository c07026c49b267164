/* _fp_score_walk.h: one score's walk in C: the prompt's keys (a list/tuple of ints through
 * _fp_hash.h's keys_of_items, a buffer of ints through _fp_score_keys.h) and
 * consumers.score.walk over the MaskTable (_masktable.h), the same (segments, ends) as the
 * Python walk. What score_pods and score_json (_fp_score_pods.h, _fp_score_answer.h) start
 * from, through _fp_score_plan.h. The masks are read ahead with prefetches (a 1M-key table
 * does not fit in cache: each key is ~2 misses).
 *
 * Any number of endpoint slots (the words of a tier's slot set live on the stack up to
 * SW_STACK, on the heap past it); at most ST_MAX stages, which RouterConfig.max_tiers is
 * validated against at start-up (consumers.router_config.MAX_TIERS, the module's MAX_STAGES).
 */

#define ST_MAX 16   /* stages (tiers): RouterConfig.max_tiers <= MAX_TIERS == this */
#define SW_STACK 16 /* words of one tier's slot set kept on the stack: 1,024 endpoint slots */
#define PF_AHEAD 8

/* ------------------------------------------------------------------ the walk */

/* bits [off, off + nbits) of the mask words w[0..W) into dst[0..sw) */
static inline void
lane_bits(const uint64_t *w, uint32_t W, uint64_t off, uint32_t nbits, uint64_t *dst, uint32_t sw)
{
    for (uint32_t i = 0; i < sw; i++) {
        uint64_t p = off + (uint64_t)i * 64;
        uint64_t wi = p >> 6, b = p & 63;
        uint64_t x = wi < W ? w[wi] >> b : 0;
        if (b && wi + 1 < W)
            x |= w[wi + 1] << (64 - b);
        uint32_t left = nbits - i * 64;
        if (left < 64)
            x &= ((uint64_t)1 << left) - 1;
        dst[i] = x;
    }
}

typedef struct {
    int32_t stage;
    int32_t first;
} SegEv;

/* One walk: its lanes, the prompt's keys and, per endpoint slot, where it entered each stage
 * and where its match ended. Set up by walk_lanes + walk_keys, run by walk_run, freed by walk_free. */
typedef struct {
    uint32_t T, sw, nbits, nslots;
    uint64_t shift[ST_MAX];
    uint64_t *words;           /* (T + 4) * sw words: the slots taking part, then walk_run's state */
    int any_start;
    Py_ssize_t n;              /* keys (full blocks) */
    uint64_t *keys;
    SegEv *segs;               /* per slot, up to T segment starts */
    uint8_t *nseg;             /* per slot */
    int32_t *endv;             /* per slot: blocks matched (-1: never matched) */
    uint64_t wstack[(ST_MAX + 4) * SW_STACK]; /* (the two stack buffers last: not cleared) */
    uint64_t kstack[512];
} Walk;

static void
walk_free(Walk *w)
{
    if (w->keys != w->kstack)
        PyMem_Free(w->keys);
    if (w->words != w->wstack)
        PyMem_Free(w->words);
    PyMem_Free(w->segs);
    PyMem_Free(w->nseg);
    PyMem_Free(w->endv);
}

/* lanes: per stage (shift, full), every stage as wide as the index's cap; start: slot mask */
static int
walk_lanes(Walk *w, PyObject *lanes, PyObject *start_o)
{
    if (!PyList_Check(lanes) || PyList_GET_SIZE(lanes) > ST_MAX) {
        PyErr_Format(PyExc_ValueError, "score: lanes must be a list of at most %d (shift, full)", ST_MAX);
        return -1;
    }
    w->T = (uint32_t)PyList_GET_SIZE(lanes);
    for (uint32_t s = 0; s < w->T; s++) {
        PyObject *ln = PyList_GET_ITEM(lanes, s);
        if (!PyTuple_Check(ln) || PyTuple_GET_SIZE(ln) != 2) {
            PyErr_SetString(PyExc_TypeError, "score: a lane is a (shift, full) tuple");
            return -1;
        }
        w->shift[s] = (uint64_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(ln, 0));
        if (PyErr_Occurred())
            return -1;
        int64_t nb = (int64_t)_PyLong_NumBits(PyTuple_GET_ITEM(ln, 1));
        if (nb < 0)
            return -1;
        if (s && (uint32_t)nb != w->nbits) {
            PyErr_SetString(PyExc_ValueError, "score: lanes of different widths");
            return -1;
        }
        w->nbits = (uint32_t)nb;
    }
    w->sw = (w->nbits + 63) / 64;
    if (w->sw == 0)
        w->sw = 1;
    w->nslots = w->sw * 64;
    if (w->sw > SW_STACK &&
        (w->words = PyMem_Calloc((size_t)(w->T + 4) * w->sw, sizeof(uint64_t))) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    uint64_t *incoming = w->words;
    PyObject *rest = Py_NewRef(start_o);
    for (uint32_t i = 0; i < w->sw; i++) {
        incoming[i] = PyLong_AsUnsignedLongLongMask(rest);
        if (incoming[i] == (uint64_t)-1 && PyErr_Occurred()) {
            Py_DECREF(rest);
            return -1;
        }
        w->any_start |= incoming[i] != 0;
        if (i + 1 < w->sw) {
            PyObject *sh = PyLong_FromLong(64);
            PyObject *next = sh ? PyNumber_Rshift(rest, sh) : NULL;
            Py_XDECREF(sh);
            Py_DECREF(rest);
            if (next == NULL)
                return -1;
            rest = next;
        }
    }
    Py_DECREF(rest);
    return 0;
}

/* the keys of every full block of `tokens` (a list/tuple of ints or a buffer of 4/8-byte ints) */
static int
walk_keys(Walk *w, PyObject *tokens, PyObject *parent, PyObject *bs_o)
{
    Py_hash_t parent_lane = PyObject_Hash(parent);
    if (parent_lane == -1 && PyErr_Occurred())
        return -1;
    Py_ssize_t bs = PyLong_AsSsize_t(bs_o);
    if (bs == -1 && PyErr_Occurred())
        return -1;
    if (bs <= 0) {
        PyErr_Format(PyExc_ValueError, "block_size must be > 0, got %zd", bs);
        return -1;
    }
    if (PyList_Check(tokens) || PyTuple_Check(tokens)) {
        w->n = PySequence_Fast_GET_SIZE(tokens) / bs;
        if (w->n > 512 && (w->keys = PyMem_Malloc((size_t)w->n * sizeof(uint64_t))) == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        return keys_of_items(PySequence_Fast_ITEMS(tokens), bs, (int64_t)parent_lane, w->keys, w->n);
    }
    Py_buffer view;
    if (PyObject_GetBuffer(tokens, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    char kind = int_kind(&view);
    if (!kind || view.ndim > 1) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_TypeError, "score: tokens must be a list/tuple of ints or a buffer of 4/8-byte ints");
        return -1;
    }
    w->n = view.len / view.itemsize / bs;
    if (w->n > 512 && (w->keys = PyMem_Malloc((size_t)w->n * sizeof(uint64_t))) == NULL) {
        PyBuffer_Release(&view);
        PyErr_NoMemory();
        return -1;
    }
    keys_of_buffer(&view, kind, bs, (int64_t)parent_lane, w->keys, w->n);
    PyBuffer_Release(&view);
    return 0;
}

/* consumers.score.walk over the table: each slot's segment starts and end */
static int
walk_run(Walk *w, const MaskTable *t)
{
    const uint32_t T = w->T, sw = w->sw, nbits = w->nbits, W = t->W;
    const Py_ssize_t n = w->n;
    const uint64_t *keys = w->keys;
    w->segs = PyMem_Malloc(sizeof(SegEv) * w->nslots * (T ? T : 1));
    w->nseg = PyMem_Calloc(w->nslots, 1);
    w->endv = PyMem_Malloc(sizeof(int32_t) * w->nslots);
    if (w->segs == NULL || w->nseg == NULL || w->endv == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (uint32_t s = 0; s < w->nslots; s++)
        w->endv[s] = -1;
    if (n == 0 || !w->any_start)
        return 0;
    SegEv *segs = w->segs;
    uint8_t *nseg = w->nseg;
    /* w->words: the start set, then per stage its slots in the match (S), the slots moving
     * down (incoming), the slots leaving a stage (carry), a stage's lane of the key's mask (mt) */
    uint64_t *S = w->words + sw, *incoming = S + (size_t)T * sw, *carry = incoming + sw, *mt = carry + sw;
    memset(S, 0, (size_t)T * sw * sizeof(uint64_t));
    memcpy(incoming, w->words, sw * sizeof(uint64_t));
    const uint64_t *prev = NULL; /* the key before's mask (NULL: in no entry) */
    int have_prev = 0;
    for (Py_ssize_t j = 0; j < n && j < PF_AHEAD * 2; j++)
        mt_prefetch_slot(t, keys[j]);
    for (Py_ssize_t j = 0; j < n && j < PF_AHEAD; j++)
        mt_prefetch_entry(t, keys[j]);
    for (Py_ssize_t j = 0; j < n; j++) {
        if (j + 2 * PF_AHEAD < n)
            mt_prefetch_slot(t, keys[j + 2 * PF_AHEAD]);
        if (j + PF_AHEAD < n)
            mt_prefetch_entry(t, keys[j + PF_AHEAD]);
        uint32_t e = mt_find(t, keys[j], NULL);
        const uint64_t *m = e == MT_NONE ? NULL : ENT(t, e)->bits;
        if (have_prev && (m == prev || (m != NULL && prev != NULL && memcmp(m, prev, W * sizeof(uint64_t)) == 0)))
            continue; /* the same mask as the key before: nothing moves */
        prev = m;
        have_prev = 1;
        memcpy(carry, incoming, sw * sizeof(uint64_t));
        memset(incoming, 0, sw * sizeof(uint64_t));
        for (uint32_t s = 0; s < T; s++) {
            if (m != NULL)
                lane_bits(m, W, w->shift[s], nbits, mt, sw);
            else
                memset(mt, 0, sw * sizeof(uint64_t));
            uint64_t *Ss = S + (size_t)s * sw;
            for (uint32_t i = 0; i < sw; i++) {
                uint64_t old = Ss[i], cur = old | carry[i];
                uint64_t nw = cur & mt[i];
                carry[i] = cur & ~mt[i];
                if (nw != old) {
                    Ss[i] = nw;
                    for (uint64_t entered = nw & ~old; entered; entered &= entered - 1) {
                        uint32_t slot = i * 64 + (uint32_t)__builtin_ctzll(entered);
                        segs[slot * T + nseg[slot]++] = (SegEv){(int32_t)s, (int32_t)j};
                    }
                }
            }
        }
        int any_carry = 0;
        for (uint32_t i = 0; i < sw; i++) {
            any_carry |= carry[i] != 0;
            for (uint64_t c = carry[i]; c; c &= c - 1) {
                uint32_t slot = i * 64 + (uint32_t)__builtin_ctzll(c);
                if (nseg[slot])
                    w->endv[slot] = (int32_t)j;
            }
        }
        if (any_carry) {
            int live = 0;
            for (uint32_t s = 0; s < T && !live; s++)
                for (uint32_t i = 0; i < sw && !live; i++)
                    live = S[(size_t)s * sw + i] != 0;
            if (!live)
                return 0;
        }
    }
    for (uint32_t s = 0; s < T; s++)
        for (uint32_t i = 0; i < sw; i++)
            for (uint64_t c = S[(size_t)s * sw + i]; c; c &= c - 1)
                w->endv[i * 64 + (uint32_t)__builtin_ctzll(c)] = (int32_t)n;
    return 0;
}

static int
walk_all(Walk *w, PyObject *const *args)
{
    memset(w, 0, offsetof(Walk, wstack));
    w->words = w->wstack;
    w->keys = w->kstack;
    if (!PyObject_TypeCheck(args[0], &MaskTableType)) {
        PyErr_SetString(PyExc_TypeError, "score: table must be a MaskTable");
        return -1;
    }
    if (walk_lanes(w, args[4], args[5]) < 0 || walk_keys(w, args[1], args[2], args[3]) < 0)
        return -1;
    return walk_run(w, (const MaskTable *)args[0]);
}
