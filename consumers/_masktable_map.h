/* _masktable_map.h: MaskTable's Python mapping interface (get, [], in, len, iteration, keys/values/items).
 * Included by _fastpath.c (one extension module, one translation unit). */
/* --- Python methods --------------------------------------------------------------------- */

static PyObject *
mt_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *names[] = {"bits", "mig_step", NULL};
    Py_ssize_t nbits, step = OA_STEP;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "n|n:MaskTable", names, &nbits, &step))
        return NULL;
    if (nbits < 1 || nbits > (1 << 20)) {
        PyErr_Format(PyExc_ValueError, "MaskTable: bits must be in [1, 2**20], got %zd", nbits);
        return NULL;
    }
    if (step < 2 || step > (1 << 20)) { /* >= 2: a rehash ends before the next one is due */
        PyErr_Format(PyExc_ValueError, "MaskTable: mig_step must be in [2, 2**20], got %zd", step);
        return NULL;
    }
    MaskTable *t = (MaskTable *)type->tp_alloc(type, 0);
    if (t == NULL)
        return NULL;
    t->W = (uint32_t)((nbits + 63) / 64);
    t->stride = mt_stride(t->W);
    t->seg_shift = mt_seg_shift(t->stride);
    t->seg_mask = ((uint32_t)1 << t->seg_shift) - 1;
    t->mig_step = (uint32_t)step;
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
    mt_store_free(t);
    PyMem_RawFree(t->slot);
    PyMem_RawFree(t->old.slot);
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
        if ((item = map_item(what, k, v)) == NULL)
            goto fail;
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

static PyObject *
mt_py_nbytes(MaskTable *t, PyObject *unused)
{
    size_t b = sizeof(MaskTable) + mt_store_nbytes(t) + ((size_t)t->slot_mask + 1) * sizeof(uint32_t) +
               (t->old.slot ? ((size_t)t->old.mask + 1) * sizeof(uint32_t) : 0);
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
