/* _fp_score.h: one score's walk in C (consumers/scorer.py's native path).
 *
 * Included by _fastpath.c after _masktable.h and _fp_hash.h (one translation unit). Two
 * functions, both pure functions of their inputs and the table:
 *
 * json_tokens(raw) -> array('I') | None
 *     The token ids of a JSON array of non-negative ints below 2**32 (the text msgspec.Raw
 *     keeps of a request's "token_ids"), without one Python int per token. None for anything
 *     else (floats, negatives, too big, not an array): the caller decodes those with msgspec,
 *     which names what is wrong and where.
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

static PyObject *array_type; /* array.array, imported on first use */

/* ------------------------------------------------------------------ json_tokens */

static PyObject *
py_json_tokens(PyObject *self, PyObject *raw)
{
    Py_buffer b;
    if (PyObject_GetBuffer(raw, &b, PyBUF_SIMPLE) < 0)
        return NULL;
    const char *p = b.buf, *end = p + b.len;
    uint32_t stack[1024];
    uint32_t *out = stack;
    size_t n = 0, cap = 1024;
    PyObject *res = NULL;
#define WS() while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) p++
    WS();
    if (p == end || *p != '[')
        goto other;
    p++;
    WS();
    if (p < end && *p == ']') {
        p++;
        goto close;
    }
    for (;;) {
        if (p == end || *p < '0' || *p > '9')
            goto other; /* '-', a string, null... */
        uint64_t v = 0;
        const char *d0 = p;
        while (p < end && *p >= '0' && *p <= '9') {
            v = v * 10 + (uint64_t)(*p - '0');
            p++;
            if (p - d0 > 10)
                goto other;
        }
        if (v >> 32 || (p < end && (*p == '.' || *p == 'e' || *p == 'E')))
            goto other;
        if (n == cap) {
            size_t ncap = cap * 2;
            uint32_t *grown = PyMem_Malloc(ncap * sizeof(uint32_t));
            if (grown == NULL) {
                PyErr_NoMemory();
                goto done;
            }
            memcpy(grown, out, n * sizeof(uint32_t));
            if (out != stack)
                PyMem_Free(out);
            out = grown;
            cap = ncap;
        }
        out[n++] = (uint32_t)v;
        WS();
        if (p < end && *p == ',') {
            p++;
            WS();
            continue;
        }
        if (p < end && *p == ']') {
            p++;
            break;
        }
        goto other;
    }
close:
    WS();
    if (p != end)
        goto other;
    if (array_type == NULL) {
        PyObject *mod = PyImport_ImportModule("array");
        if (mod == NULL)
            goto done;
        array_type = PyObject_GetAttrString(mod, "array");
        Py_DECREF(mod);
        if (array_type == NULL)
            goto done;
    }
    PyObject *bytes = PyBytes_FromStringAndSize((const char *)out, (Py_ssize_t)(n * sizeof(uint32_t)));
    if (bytes == NULL)
        goto done;
    res = PyObject_CallFunction(array_type, "sO", "I", bytes);
    Py_DECREF(bytes);
    goto done;
other:
    res = Py_NewRef(Py_None);
done:
#undef WS
    if (out != stack)
        PyMem_Free(out);
    PyBuffer_Release(&b);
    return res;
}

/* ------------------------------------------------------------------ the keys */

/* keys of every full block of the buffer's ints (itemsize 4 or 8, signed or not) */
static void
keys_of_buffer(const Py_buffer *v, char kind, Py_ssize_t bs, int64_t parent_lane, uint64_t *keys, Py_ssize_t nb)
{
    const char *base = v->buf;
    uint64_t k = 0;
    for (Py_ssize_t b = 0; b < nb; b++) {
        uint64_t acc = XXP5;
        Py_ssize_t i0 = b * bs;
        for (Py_ssize_t j = 0; j < bs; j++) {
            int64_t h;
            const char *q = base + (i0 + j) * v->itemsize;
            switch (kind) {
            case 'I': { uint32_t x; memcpy(&x, q, 4); h = (int64_t)x; break; }
            case 'i': { int32_t x; memcpy(&x, q, 4); h = int_hash_s(x); break; }
            case 'Q': { uint64_t x; memcpy(&x, q, 8); h = int_hash_u(x); break; }
            default: { int64_t x; memcpy(&x, q, 8); h = int_hash_s(x); break; }
            }
            acc = lane_mix(acc, h);
        }
        k = b ? chain_step(k, tuple_end(acc, (uint64_t)bs)) : chain_step_lane(parent_lane, tuple_end(acc, (uint64_t)bs));
        keys[b] = k;
    }
}

/* keys of every full block of a list/tuple of ints (CPython's own hash per item); -1 on error */
static int
keys_of_items(PyObject **items, Py_ssize_t bs, int64_t parent_lane, uint64_t *keys, Py_ssize_t nb)
{
    uint64_t k = 0;
    for (Py_ssize_t b = 0; b < nb; b++) {
        uint64_t acc = XXP5;
        PyObject **it = items + b * bs;
        for (Py_ssize_t j = 0; j < bs; j++) {
            Py_hash_t h = PyObject_Hash(it[j]);
            if (h == -1 && PyErr_Occurred())
                return -1;
            acc = lane_mix(acc, (int64_t)h);
        }
        k = b ? chain_step(k, tuple_end(acc, (uint64_t)bs)) : chain_step_lane(parent_lane, tuple_end(acc, (uint64_t)bs));
        keys[b] = k;
    }
    return 0;
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

static PyObject *
py_score_walk(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "score_walk(table, tokens, parent, block_size, lanes, start)");
        return NULL;
    }
    if (!PyObject_TypeCheck(args[0], &MaskTableType)) {
        PyErr_SetString(PyExc_TypeError, "score_walk: table must be a MaskTable");
        return NULL;
    }
    MaskTable *t = (MaskTable *)args[0];
    PyObject *tokens = args[1], *lanes = args[4], *start_o = args[5];
    Py_hash_t parent_lane = PyObject_Hash(args[2]);
    if (parent_lane == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t bs = PyLong_AsSsize_t(args[3]);
    if (bs == -1 && PyErr_Occurred())
        return NULL;
    if (bs <= 0) {
        PyErr_Format(PyExc_ValueError, "block_size must be > 0, got %zd", bs);
        return NULL;
    }
    /* --- lanes: per stage (shift, full); every stage has the same width (the index's cap) */
    if (!PyList_Check(lanes) || PyList_GET_SIZE(lanes) > ST_MAX) {
        PyErr_Format(PyExc_ValueError, "score_walk: lanes must be a list of at most %d (shift, full)", ST_MAX);
        return NULL;
    }
    uint32_t T = (uint32_t)PyList_GET_SIZE(lanes);
    uint64_t shift[ST_MAX];
    uint32_t nbits = 0;
    for (uint32_t s = 0; s < T; s++) {
        PyObject *ln = PyList_GET_ITEM(lanes, s);
        if (!PyTuple_Check(ln) || PyTuple_GET_SIZE(ln) != 2) {
            PyErr_SetString(PyExc_TypeError, "score_walk: a lane is a (shift, full) tuple");
            return NULL;
        }
        shift[s] = (uint64_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(ln, 0));
        if (PyErr_Occurred())
            return NULL;
        int64_t nb = (int64_t)_PyLong_NumBits(PyTuple_GET_ITEM(ln, 1));
        if (nb < 0)
            return NULL;
        if (s && (uint32_t)nb != nbits) {
            PyErr_SetString(PyExc_ValueError, "score_walk: lanes of different widths");
            return NULL;
        }
        nbits = (uint32_t)nb;
    }
    uint32_t sw = (nbits + 63) / 64;
    if (sw > SW_MAX) {
        PyErr_Format(PyExc_ValueError, "score_walk: more than %d slots per tier", SW_MAX * 64);
        return NULL;
    }
    if (sw == 0)
        sw = 1;
    /* --- start: the slot mask of the endpoints taking part */
    uint64_t incoming[SW_MAX] = {0};
    int any_start = 0;
    {
        PyObject *rest = Py_NewRef(start_o);
        for (uint32_t i = 0; i < sw; i++) {
            incoming[i] = PyLong_AsUnsignedLongLongMask(rest);
            if (incoming[i] == (uint64_t)-1 && PyErr_Occurred()) {
                Py_DECREF(rest);
                return NULL;
            }
            any_start |= incoming[i] != 0;
            if (i + 1 < sw) {
                PyObject *sh = PyLong_FromLong(64);
                PyObject *next = sh ? PyNumber_Rshift(rest, sh) : NULL;
                Py_XDECREF(sh);
                Py_DECREF(rest);
                if (next == NULL)
                    return NULL;
                rest = next;
            }
        }
        Py_DECREF(rest);
    }
    /* --- the keys */
    Py_buffer view;
    int have_view = 0;
    PyObject *seq = NULL;
    Py_ssize_t n_tok;
    char kind = 0;
    if (PyList_Check(tokens) || PyTuple_Check(tokens)) {
        seq = Py_NewRef(tokens);
        n_tok = PySequence_Fast_GET_SIZE(seq);
    } else {
        if (PyObject_GetBuffer(tokens, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
            return NULL;
        have_view = 1;
        kind = int_kind(&view);
        if (!kind || view.ndim > 1) {
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_TypeError, "score_walk: tokens must be a list/tuple of ints or a buffer of 4/8-byte ints");
            return NULL;
        }
        n_tok = view.len / view.itemsize;
    }
    Py_ssize_t n = n_tok / bs;
    PyObject *result = NULL, *segments = NULL, *ends = NULL;
    uint64_t kstack[512];
    uint64_t *keys = n <= 512 ? kstack : PyMem_Malloc((size_t)n * sizeof(uint64_t));
    uint32_t nslots = sw * 64;
    SegEv *segs = NULL;   /* per slot, up to T segment starts */
    uint8_t *nseg = NULL; /* per slot */
    int32_t *endv = NULL; /* per slot: blocks matched, -1 none recorded */
    if (keys == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    if (have_view)
        keys_of_buffer(&view, kind, bs, (int64_t)parent_lane, keys, n);
    else if (keys_of_items(PySequence_Fast_ITEMS(seq), bs, (int64_t)parent_lane, keys, n) < 0)
        goto fail;
    segments = PyDict_New();
    ends = PyDict_New();
    if (segments == NULL || ends == NULL)
        goto fail;
    if (n == 0 || !any_start)
        goto build;
    segs = PyMem_Malloc(sizeof(SegEv) * nslots * (T ? T : 1));
    nseg = PyMem_Calloc(nslots, 1);
    endv = PyMem_Malloc(sizeof(int32_t) * nslots);
    if (segs == NULL || nseg == NULL || endv == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (uint32_t s = 0; s < nslots; s++)
        endv[s] = -1;
    {
        uint64_t S[ST_MAX][SW_MAX];
        memset(S, 0, sizeof(S));
        const uint32_t W = t->W;
        uint64_t zero[64] = {0};
        const uint64_t *prev = NULL;
        for (Py_ssize_t j = 0; j < n && j < PF_AHEAD * 2; j++)
            mt_prefetch_slot(t, keys[j]);
        for (Py_ssize_t j = 0; j < n && j < PF_AHEAD; j++)
            mt_prefetch_entry(t, keys[j]);
        Py_ssize_t j;
        for (j = 0; j < n; j++) {
            if (j + 2 * PF_AHEAD < n)
                mt_prefetch_slot(t, keys[j + 2 * PF_AHEAD]);
            if (j + PF_AHEAD < n)
                mt_prefetch_entry(t, keys[j + PF_AHEAD]);
            uint32_t e = mt_find(t, keys[j], NULL);
            const uint64_t *m = (e == MT_NONE || W > 64) ? zero : ENT(t, e)->bits;
            if (e != MT_NONE && W > 64) { /* (over 4,096 lanes: not a layout the index makes) */
                PyErr_SetString(PyExc_ValueError, "score_walk: masks wider than 4,096 bits");
                goto fail;
            }
            if (prev != NULL && memcmp(m, prev, W * sizeof(uint64_t)) == 0)
                continue; /* the same mask as the key before: nothing moves */
            prev = m;
            uint64_t carry[SW_MAX];
            memcpy(carry, incoming, sizeof(carry));
            memset(incoming, 0, sizeof(incoming));
            for (uint32_t s = 0; s < T; s++) {
                uint64_t mt[SW_MAX];
                lane_bits(m, W, shift[s], nbits, mt, sw);
                for (uint32_t i = 0; i < sw; i++) {
                    uint64_t old = S[s][i], cur = old | carry[i];
                    uint64_t nw = cur & mt[i];
                    carry[i] = cur & ~mt[i];
                    if (nw != old) {
                        S[s][i] = nw;
                        uint64_t entered = nw & ~old;
                        while (entered) {
                            uint32_t slot = i * 64 + (uint32_t)__builtin_ctzll(entered);
                            entered &= entered - 1;
                            segs[slot * T + nseg[slot]++] = (SegEv){(int32_t)s, (int32_t)j};
                        }
                    }
                }
            }
            int any_carry = 0;
            for (uint32_t i = 0; i < sw; i++) {
                uint64_t c = carry[i];
                any_carry |= c != 0;
                while (c) {
                    uint32_t slot = i * 64 + (uint32_t)__builtin_ctzll(c);
                    c &= c - 1;
                    if (nseg[slot])
                        endv[slot] = (int32_t)j;
                }
            }
            if (any_carry) {
                int live = 0;
                for (uint32_t s = 0; s < T && !live; s++)
                    for (uint32_t i = 0; i < sw; i++)
                        if (S[s][i]) {
                            live = 1;
                            break;
                        }
                if (!live)
                    break;
            }
        }
        for (uint32_t s = 0; s < T; s++)
            for (uint32_t i = 0; i < sw; i++)
                for (uint64_t c = S[s][i]; c; c &= c - 1)
                    endv[i * 64 + (uint32_t)__builtin_ctzll(c)] = (int32_t)n;
    }
    /* --- the answer, in walk()'s shape */
    for (uint32_t slot = 0; slot < nslots; slot++) {
        if (nseg[slot]) {
            PyObject *lst = PyList_New(nseg[slot]);
            if (lst == NULL)
                goto fail;
            for (uint32_t q = 0; q < nseg[slot]; q++) {
                SegEv ev = segs[slot * T + q];
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
            if (rc == 0 && endv[slot] >= 0) {
                PyObject *eo = PyLong_FromLong(endv[slot]);
                rc = eo == NULL ? -1 : PyDict_SetItem(ends, ko, eo);
                Py_XDECREF(eo);
            }
            Py_XDECREF(ko);
            if (rc < 0)
                goto fail;
        }
    }
build:
    result = Py_BuildValue("(nOO)", n, segments, ends);
fail:
    Py_XDECREF(segments);
    Py_XDECREF(ends);
    if (keys != kstack)
        PyMem_Free(keys);
    PyMem_Free(segs);
    PyMem_Free(nseg);
    PyMem_Free(endv);
    if (have_view)
        PyBuffer_Release(&view);
    Py_XDECREF(seq);
    return result;
}
