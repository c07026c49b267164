/* _fp_score.h: one score's walk in C (consumers/scorer.py's native path).
 *
 * Included by _fastpath.c after _masktable.h and _fp_hash.h (one translation unit); it
 * includes _fp_score_pods.h (json_tokens, score_pods: the API-facing end). Pure functions of
 * their inputs and the table:
 *
 * score_walk(table, tokens, parent, block_size, lanes, start) -> (n_keys, segments, ends)
 *     chain_keys(tokens, parent, block_size) followed by consumers.score.walk over the
 *     MaskTable, in one call: the same keys bit for bit (the hashes of _fp_hash.h) and the
 *     same (segments, ends). tokens: a list or tuple of ints (hashed as CPython hashes them)
 *     or a buffer of 4- or 8-byte ints (array('I'), array('q'), numpy...). The masks are read
 *     ahead with prefetches (a 1M-key table does not fit in cache: each key is ~2 misses).
 */

#define SW_MAX 16 /* words of one tier's slot set: up to 1,024 endpoint slots */
#define ST_MAX 16 /* stages */
#define PF_AHEAD 8

/* ------------------------------------------------------------------ the keys */

/* the hash CPython gives item i of a buffer of ints of this kind */
static inline __attribute__((always_inline)) int64_t
item_hash(const char *base, Py_ssize_t i, char kind)
{
    switch (kind) {
    case 'I': { uint32_t x; memcpy(&x, base + i * 4, 4); return (int64_t)x; }
    case 'i': { int32_t x; memcpy(&x, base + i * 4, 4); return int_hash_s(x); }
    case 'Q': { uint64_t x; memcpy(&x, base + i * 8, 8); return int_hash_u(x); }
    default: { int64_t x; memcpy(&x, base + i * 8, 8); return int_hash_s(x); }
    }
}

/* content[b]: the tuple hash of block b's bs ints, for nb blocks. The blocks are independent:
 * four at a time, so that their chains of multiplies overlap (one block's is serial). kind is a
 * constant where this is inlined: no per-item switch. */
static inline __attribute__((always_inline)) void
contents_of(const char *base, char kind, Py_ssize_t bs, Py_ssize_t nb, int64_t *content)
{
    Py_ssize_t b = 0;
    for (; b + 4 <= nb; b += 4) {
        uint64_t a0 = XXP5, a1 = XXP5, a2 = XXP5, a3 = XXP5;
        Py_ssize_t i0 = b * bs;
        for (Py_ssize_t j = 0; j < bs; j++) {
            a0 = lane_mix(a0, item_hash(base, i0 + j, kind));
            a1 = lane_mix(a1, item_hash(base, i0 + bs + j, kind));
            a2 = lane_mix(a2, item_hash(base, i0 + 2 * bs + j, kind));
            a3 = lane_mix(a3, item_hash(base, i0 + 3 * bs + j, kind));
        }
        content[b] = tuple_end(a0, (uint64_t)bs);
        content[b + 1] = tuple_end(a1, (uint64_t)bs);
        content[b + 2] = tuple_end(a2, (uint64_t)bs);
        content[b + 3] = tuple_end(a3, (uint64_t)bs);
    }
    for (; b < nb; b++) {
        uint64_t a = XXP5;
        for (Py_ssize_t j = 0; j < bs; j++)
            a = lane_mix(a, item_hash(base, b * bs + j, kind));
        content[b] = tuple_end(a, (uint64_t)bs);
    }
}

#define KB_CHUNK 64

/* keys of every full block of the buffer's ints (itemsize 4 or 8, signed or not): the blocks'
 * content hashes a chunk at a time, then the chain through them (a key is < 2**60, so the
 * hash of a key, the next step's lane, is the key itself) */
static void
keys_of_buffer(const Py_buffer *v, char kind, Py_ssize_t bs, int64_t parent_lane, uint64_t *keys, Py_ssize_t nb)
{
    int64_t content[KB_CHUNK];
    int64_t lane = parent_lane;
    for (Py_ssize_t b0 = 0; b0 < nb; b0 += KB_CHUNK) {
        Py_ssize_t m = nb - b0 < KB_CHUNK ? nb - b0 : KB_CHUNK;
        const char *base = (const char *)v->buf + b0 * bs * v->itemsize;
        if (bs == 16 && kind == 'I') /* the default block size of the API's token buffers: unrolled */
            contents_of(base, 'I', 16, m, content);
        else if (kind == 'I')
            contents_of(base, 'I', bs, m, content);
        else if (kind == 'i')
            contents_of(base, 'i', bs, m, content);
        else if (kind == 'Q')
            contents_of(base, 'Q', bs, m, content);
        else
            contents_of(base, 'q', bs, m, content);
        for (Py_ssize_t b = 0; b < m; b++) {
            uint64_t k = chain_step_lane(lane, content[b]);
            keys[b0 + b] = k;
            lane = (int64_t)k;
        }
    }
}

/* the buffer's item kind for keys_of_buffer: 'I', 'i', 'Q', 'q', or 0 if not a 4/8-byte int */
static char
int_kind(const Py_buffer *v)
{
    const char *f = v->format ? v->format : "B";
    if (*f == '@' || *f == '=' || *f == '<')
        f++;
    if (f[0] == 0 || f[1] != 0)
        return 0;
    int is_signed = f[0] == 'i' || f[0] == 'l' || f[0] == 'q';
    int is_unsigned = f[0] == 'I' || f[0] == 'L' || f[0] == 'Q';
    if (!(is_signed || is_unsigned) || (v->itemsize != 4 && v->itemsize != 8))
        return 0;
    return v->itemsize == 4 ? (is_signed ? 'i' : 'I') : (is_signed ? 'q' : 'Q');
}

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
    uint64_t incoming[SW_MAX]; /* the slots taking part */
    int any_start;
    Py_ssize_t n;              /* keys (full blocks) */
    uint64_t *keys;
    uint64_t kstack[512];
    SegEv *segs;               /* per slot, up to T segment starts */
    uint8_t *nseg;             /* per slot */
    int32_t *endv;             /* per slot: blocks matched (-1: never matched) */
} Walk;

static void
walk_free(Walk *w)
{
    if (w->keys != w->kstack)
        PyMem_Free(w->keys);
    PyMem_Free(w->segs);
    PyMem_Free(w->nseg);
    PyMem_Free(w->endv);
}

/* lanes: per stage (shift, full), every stage as wide as the index's cap; start: slot mask */
static int
walk_lanes(Walk *w, PyObject *lanes, PyObject *start_o)
{
    if (!PyList_Check(lanes) || PyList_GET_SIZE(lanes) > ST_MAX) {
        PyErr_Format(PyExc_ValueError, "score_walk: lanes must be a list of at most %d (shift, full)", ST_MAX);
        return -1;
    }
    w->T = (uint32_t)PyList_GET_SIZE(lanes);
    for (uint32_t s = 0; s < w->T; s++) {
        PyObject *ln = PyList_GET_ITEM(lanes, s);
        if (!PyTuple_Check(ln) || PyTuple_GET_SIZE(ln) != 2) {
            PyErr_SetString(PyExc_TypeError, "score_walk: a lane is a (shift, full) tuple");
            return -1;
        }
        w->shift[s] = (uint64_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(ln, 0));
        if (PyErr_Occurred())
            return -1;
        int64_t nb = (int64_t)_PyLong_NumBits(PyTuple_GET_ITEM(ln, 1));
        if (nb < 0)
            return -1;
        if (s && (uint32_t)nb != w->nbits) {
            PyErr_SetString(PyExc_ValueError, "score_walk: lanes of different widths");
            return -1;
        }
        w->nbits = (uint32_t)nb;
    }
    w->sw = (w->nbits + 63) / 64;
    if (w->sw > SW_MAX) {
        PyErr_Format(PyExc_ValueError, "score_walk: more than %d slots per tier", SW_MAX * 64);
        return -1;
    }
    if (w->sw == 0)
        w->sw = 1;
    w->nslots = w->sw * 64;
    PyObject *rest = Py_NewRef(start_o);
    for (uint32_t i = 0; i < w->sw; i++) {
        w->incoming[i] = PyLong_AsUnsignedLongLongMask(rest);
        if (w->incoming[i] == (uint64_t)-1 && PyErr_Occurred()) {
            Py_DECREF(rest);
            return -1;
        }
        w->any_start |= w->incoming[i] != 0;
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
        PyErr_SetString(PyExc_TypeError, "score_walk: tokens must be a list/tuple of ints or a buffer of 4/8-byte ints");
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
    if (W > 64) { /* over 4,096 lanes: not a layout the index makes */
        PyErr_SetString(PyExc_ValueError, "score_walk: masks wider than 4,096 bits");
        return -1;
    }
    SegEv *segs = w->segs;
    uint8_t *nseg = w->nseg;
    uint64_t S[ST_MAX][SW_MAX];
    memset(S, 0, sizeof(S));
    uint64_t incoming[SW_MAX];
    memcpy(incoming, w->incoming, sizeof(incoming));
    static const uint64_t zero[64];
    const uint64_t *prev = NULL;
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
        const uint64_t *m = e == MT_NONE ? zero : ENT(t, e)->bits;
        if (prev != NULL && memcmp(m, prev, W * sizeof(uint64_t)) == 0)
            continue; /* the same mask as the key before: nothing moves */
        prev = m;
        uint64_t carry[SW_MAX];
        memcpy(carry, incoming, sizeof(carry));
        memset(incoming, 0, sizeof(incoming));
        for (uint32_t s = 0; s < T; s++) {
            uint64_t mt[SW_MAX];
            lane_bits(m, W, w->shift[s], nbits, mt, sw);
            for (uint32_t i = 0; i < sw; i++) {
                uint64_t old = S[s][i], cur = old | carry[i];
                uint64_t nw = cur & mt[i];
                carry[i] = cur & ~mt[i];
                if (nw != old) {
                    S[s][i] = nw;
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
                    live = S[s][i] != 0;
            if (!live)
                return 0;
        }
    }
    for (uint32_t s = 0; s < T; s++)
        for (uint32_t i = 0; i < sw; i++)
            for (uint64_t c = S[s][i]; c; c &= c - 1)
                w->endv[i * 64 + (uint32_t)__builtin_ctzll(c)] = (int32_t)n;
    return 0;
}

static int
walk_all(Walk *w, PyObject *const *args)
{
    memset(w, 0, offsetof(Walk, kstack));
    w->keys = w->kstack;
    w->segs = NULL;
    w->nseg = NULL;
    w->endv = NULL;
    if (!PyObject_TypeCheck(args[0], &MaskTableType)) {
        PyErr_SetString(PyExc_TypeError, "score_walk: table must be a MaskTable");
        return -1;
    }
    if (walk_lanes(w, args[4], args[5]) < 0 || walk_keys(w, args[1], args[2], args[3]) < 0)
        return -1;
    return walk_run(w, (const MaskTable *)args[0]);
}

static PyObject *
py_score_walk(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "score_walk(table, tokens, parent, block_size, lanes, start)");
        return NULL;
    }
    Walk w;
    PyObject *result = NULL, *segments = NULL, *ends = NULL;
    if (walk_all(&w, args) < 0)
        goto fail;
    segments = PyDict_New();
    ends = PyDict_New();
    if (segments == NULL || ends == NULL)
        goto fail;
    for (uint32_t slot = 0; slot < w.nslots; slot++) {
        uint32_t ns = w.nseg[slot];
        if (!ns)
            continue;
        PyObject *lst = PyList_New(ns);
        if (lst == NULL)
            goto fail;
        for (uint32_t q = 0; q < ns; q++) {
            SegEv ev = w.segs[slot * w.T + q];
            PyObject *tup = Py_BuildValue("(ii)", ev.stage, ev.first);
            if (tup == NULL) {
                Py_DECREF(lst);
                goto fail;
            }
            PyList_SET_ITEM(lst, q, tup);
        }
        PyObject *ko = PyLong_FromUnsignedLong(slot);
        int rc = ko == NULL ? -1 : PyDict_SetItem(segments, ko, lst);
        Py_DECREF(lst);
        if (rc == 0 && w.endv[slot] >= 0) {
            PyObject *eo = PyLong_FromLong(w.endv[slot]);
            rc = eo == NULL ? -1 : PyDict_SetItem(ends, ko, eo);
            Py_XDECREF(eo);
        }
        Py_XDECREF(ko);
        if (rc < 0)
            goto fail;
    }
    result = Py_BuildValue("(nOO)", w.n, segments, ends);
fail:
    Py_XDECREF(segments);
    Py_XDECREF(ends);
    walk_free(&w);
    return result;
}

#include "_fp_score_pods.h"
