/* _masktable_ops.h: MaskTable's index operations for Python (set/clear bits, chains, evict, grow) and its type.
 * Included by _fastpath.c (one extension module, one translation unit). */
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

/* drop the oldest keys while entries > target or len > target; appends each key to `out`
 * unless it is NULL; adds keys and entries dropped to *keys / *entries; -1 on error */
static int
mt_evict_to(MaskTable *t, long long target, PyObject *out, long long *keys, long long *entries)
{
    while ((t->entries > target || (long long)t->n > target) && t->head != MT_NONE) {
        uint32_t e = t->head;
        if (out != NULL) {
            PyObject *k = PyLong_FromUnsignedLongLong(ENT(t, e)->key);
            if (k == NULL || PyList_Append(out, k) < 0) {
                Py_XDECREF(k);
                return -1;
            }
            Py_DECREF(k);
        }
        int c = mt_popcount(ENT(t, e)->bits, t->W);
        t->entries -= c;
        *entries += c;
        *keys += 1;
        uint32_t pos;
        mt_find(t, ENT(t, e)->key, &pos);
        mt_delete(t, pos, e);
    }
    return 0;
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
    long long dropped = 0, nkeys = 0;
    if (mt_evict_to(t, target, out, &nkeys, &dropped) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return Py_BuildValue("(NL)", out, dropped);
}

/* load(items): add (key, mask, parent-or-None) items in order (oldest first) to an empty or
 * partly filled table; a key already present is overwritten and moved to the newest end */
static PyObject *
mt_py_load(MaskTable *t, PyObject *arg)
{
    PyObject *seq = PySequence_Fast(arg, "load: a sequence of (key, mask, parent) tuples");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *shift = NULL, *cur = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *it = PySequence_Fast_GET_ITEM(seq, i);
        uint64_t k, p = MT_NOPAR;
        if (!PyTuple_Check(it) || PyTuple_GET_SIZE(it) != 3 || !mt_key_of(PyTuple_GET_ITEM(it, 0), &k) ||
            !PyLong_Check(PyTuple_GET_ITEM(it, 1)) || Py_SIZE(PyTuple_GET_ITEM(it, 1)) < 0 ||
            (PyTuple_GET_ITEM(it, 2) != Py_None && !mt_key_of(PyTuple_GET_ITEM(it, 2), &p))) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "load: item %zd is not (key, mask >= 0, parent or None) of u64 ints", i);
            goto fail;
        }
        int created;
        uint32_t e = mt_get_or_add(t, k, &created);
        if (e == MT_NONE)
            goto fail;
        MEnt *ent = ENT(t, e);
        if (!created) {
            t->entries -= mt_popcount(ent->bits, t->W);
            if (e != t->tail) {
                mt_unlink(t, e);
                mt_link_tail(t, e);
            }
        }
        ent->par = p;
        cur = Py_NewRef(PyTuple_GET_ITEM(it, 1));
        for (uint32_t j = 0; j < t->W; j++) {
            ent->bits[j] = (uint64_t)PyLong_AsUnsignedLongLongMask(cur);
            if (PyErr_Occurred())
                goto fail;
            if (shift == NULL && (shift = PyLong_FromLong(64)) == NULL)
                goto fail;
            PyObject *nx = PyNumber_Rshift(cur, shift);
            Py_SETREF(cur, nx);
            if (cur == NULL)
                goto fail;
        }
        int rest = PyObject_IsTrue(cur);
        Py_CLEAR(cur);
        if (rest) {
            PyErr_Format(PyExc_ValueError, "load: item %zd has a mask wider than the table's %u bits", i,
                         (unsigned)t->W * 64);
            goto fail;
        }
        t->entries += mt_popcount(ent->bits, t->W);
    }
    t->version++;
    Py_XDECREF(shift);
    Py_DECREF(seq);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(cur);
    Py_XDECREF(shift);
    Py_DECREF(seq);
    return NULL;
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
    MaskTable d = {0}; /* the new entry store (only its store fields are used) */
    d.stride = mt_stride(W2);
    d.seg_shift = mt_seg_shift(d.stride);
    d.seg_mask = ((uint32_t)1 << d.seg_shift) - 1;
    uint64_t unused_moved = 0;
    while (d.cap < t->used)
        if (mt_store_add(&d, &unused_moved) < 0) {
            mt_store_free(&d);
            return NULL;
        }
    for (uint32_t e = 0; e < t->used; e++) { /* every entry, free ones too (their links matter) */
        const MEnt *o = ENT(t, e);
        MEnt *n = ENT(&d, e);
        n->key = o->key;
        n->par = o->par;
        n->prv = o->prv;
        n->nxt = o->nxt;
        for (uint32_t tier = 0; tier < tiers; tier++)
            for (uint32_t s = 0; s < old_cap; s++) {
                uint32_t b = tier * old_cap + s;
                if (o->bits[b >> 6] >> (b & 63) & 1) {
                    uint32_t nb = tier * new_cap + s;
                    n->bits[nb >> 6] |= (uint64_t)1 << (nb & 63);
                }
            }
    }
    mt_store_free(t);
    t->seg = d.seg;
    t->seg_raw = d.seg_raw;
    t->nseg = d.nseg;
    t->seg_room = d.seg_room;
    t->cap = d.cap;
    t->seg_shift = d.seg_shift;
    t->seg_mask = d.seg_mask;
    size_t stride2 = d.stride;
    t->stride = stride2;
    t->W = W2;
    t->version++;
    Py_RETURN_NONE;
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
    {"load", (PyCFunction)mt_py_load, METH_O, "load(items): add (key, mask, parent) items, oldest first"},
    {"grow", (PyCFunction)mt_py_grow, METH_VARARGS, "grow(old_cap, new_cap, tiers): re-lay every mask"},
    {"nbytes", (PyCFunction)mt_py_nbytes, METH_NOARGS, "bytes held"},
    {"growth_stats", (PyCFunction)mt_py_growth_stats, METH_NOARGS, "how growth moved entries (for tests)"},
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

