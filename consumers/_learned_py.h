/* _learned_py.h: LearnedTable's Python methods and type.
 * Included by _fastpath.c (one extension module, one translation unit). */
/* --- Python methods --------------------------------------------------------------------- */

static PyObject *
lt_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *names[] = {"mig_step", NULL};
    Py_ssize_t step = OA_STEP;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|$n:LearnedTable", names, &step))
        return NULL;
    if (step < 2 || step > (1 << 20)) { /* >= 2: a rehash ends before the next one is due */
        PyErr_Format(PyExc_ValueError, "LearnedTable: mig_step must be in [2, 2**20], got %zd", step);
        return NULL;
    }
    LearnedTable *m = (LearnedTable *)type->tp_alloc(type, 0);
    if (m == NULL)
        return NULL;
    m->slot = PyMem_RawCalloc(16, sizeof(uint32_t));
    if (m->slot == NULL) {
        Py_DECREF(m);
        return PyErr_NoMemory();
    }
    m->slot_mask = 15;
    m->mig_step = (uint32_t)step;
    return (PyObject *)m;
}

static int
lt_traverse(LearnedTable *m, visitproc visit, void *arg)
{
    Py_VISIT(m->dict);
    for (uint32_t e = 0; e < m->used; e++)
        if (m->ent[e].tag == LT_OBJ)
            Py_VISIT((PyObject *)(uintptr_t)m->ent[e].val);
    return 0;
}

static int
lt_clear(LearnedTable *m)
{
    Py_CLEAR(m->dict);
    for (uint32_t e = 0; e < m->used; e++)
        if (m->ent[e].tag == LT_OBJ) {
            m->ent[e].tag = LT_DEAD;
            Py_DECREF((PyObject *)(uintptr_t)m->ent[e].val);
        }
    return 0;
}

static void
lt_dealloc(LearnedTable *m)
{
    PyObject_GC_UnTrack(m);
    lt_clear(m);
    PyMem_RawFree(m->ent);
    PyMem_RawFree(m->slot);
    PyMem_RawFree(m->old.slot);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static Py_ssize_t
lt_py_len(LearnedTable *m)
{
    return lt_len(m);
}

static int
lt_contains(LearnedTable *m, PyObject *o)
{
    if (m->dict != NULL)
        return PyDict_Contains(m->dict, o);
    uint64_t k;
    if (!lt_key(o, &k)) {
        /* never stored inline; but an equal key of another type? only ints equal ints */
        if (PyErr_Occurred())
            return -1;
        return 0;
    }
    return lt_find(m, k, NULL) != MT_NONE;
}

static PyObject *
lt_lookup_obj(LearnedTable *m, PyObject *o)
{
    /* borrowed-or-new semantics hidden: returns a new reference or NULL (absent, no error) */
    if (m->dict != NULL) {
        PyObject *v = PyDict_GetItemWithError(m->dict, o);
        Py_XINCREF(v);
        return v;
    }
    uint64_t k;
    if (!lt_key(o, &k))
        return NULL;
    uint32_t e = lt_find(m, k, NULL);
    return e == MT_NONE ? NULL : lt_value_obj(&m->ent[e]);
}

static PyObject *
lt_subscript(LearnedTable *m, PyObject *o)
{
    PyObject *v = lt_lookup_obj(m, o);
    if (v == NULL && !PyErr_Occurred())
        PyErr_SetObject(PyExc_KeyError, o);
    return v;
}

static PyObject *
lt_get(LearnedTable *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get(key, default=None)");
        return NULL;
    }
    PyObject *v = lt_lookup_obj(m, args[0]);
    if (v != NULL || PyErr_Occurred())
        return v;
    v = nargs == 2 ? args[1] : Py_None;
    Py_INCREF(v);
    return v;
}

static int
lt_setitem(LearnedTable *m, PyObject *key, PyObject *value)
{
    uint64_t k;
    if (m->dict == NULL && !lt_key(key, &k)) {
        if (PyErr_Occurred())
            return -1;
        if (PyObject_Hash(key) == -1)
            return -1; /* unhashable: the dict's error, before converting */
        if (value == NULL) { /* deleting a key that cannot be here */
            PyErr_SetObject(PyExc_KeyError, key);
            return -1;
        }
        if (lt_to_dict(m) < 0)
            return -1;
    }
    if (m->dict != NULL)
        return value == NULL ? PyDict_DelItem(m->dict, key) : PyDict_SetItem(m->dict, key, value);
    if (value == NULL) {
        uint32_t pos;
        uint32_t e = lt_find(m, k, &pos);
        if (e == MT_NONE) {
            PyErr_SetObject(PyExc_KeyError, key);
            return -1;
        }
        lt_delete_at(m, pos, e);
        return 0;
    }
    uint32_t tag;
    uint64_t val;
    lt_val(value, &tag, &val);
    return lt_set(m, k, tag, val);
}

static PyObject *
lt_update(LearnedTable *m, PyObject *pairs)
{
    PyObject *it;
    if (PyDict_Check(pairs)) {
        PyObject *items = PyDict_Items(pairs);
        if (items == NULL)
            return NULL;
        it = PyObject_GetIter(items);
        Py_DECREF(items);
    } else {
        it = PyObject_GetIter(pairs);
    }
    if (it == NULL)
        return NULL;
    PyObject *item;
    while ((item = PyIter_Next(it)) != NULL) {
        PyObject *kv = PySequence_Fast(item, "update: expected (key, value) pairs");
        Py_DECREF(item);
        if (kv == NULL) {
            Py_DECREF(it);
            return NULL;
        }
        if (PySequence_Fast_GET_SIZE(kv) != 2) {
            Py_DECREF(kv);
            Py_DECREF(it);
            PyErr_SetString(PyExc_ValueError, "update: expected (key, value) pairs");
            return NULL;
        }
        int rc = lt_setitem(m, PySequence_Fast_GET_ITEM(kv, 0), PySequence_Fast_GET_ITEM(kv, 1));
        Py_DECREF(kv);
        if (rc < 0) {
            Py_DECREF(it);
            return NULL;
        }
    }
    Py_DECREF(it);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/* keys (0), values (1), items (2), oldest first; at most `limit` (-1: all) */
static PyObject *
lt_list(LearnedTable *m, int what, Py_ssize_t limit)
{
    if (m->dict != NULL) {
        PyObject *all = what == 0 ? PyDict_Keys(m->dict) : what == 1 ? PyDict_Values(m->dict) : PyDict_Items(m->dict);
        if (all == NULL || limit < 0 || PyList_GET_SIZE(all) <= limit)
            return all;
        PyObject *cut = PyList_GetSlice(all, 0, limit);
        Py_DECREF(all);
        return cut;
    }
    Py_ssize_t n = limit < 0 || limit > (Py_ssize_t)m->live ? (Py_ssize_t)m->live : limit;
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    Py_ssize_t i = 0;
    for (uint32_t e = 0; e < m->used && i < n; e++) {
        const LEntry *x = &m->ent[e];
        if (x->tag == LT_DEAD)
            continue;
        PyObject *k = NULL, *v = NULL, *item;
        if (what != 1 && (k = PyLong_FromUnsignedLongLong(x->key)) == NULL)
            goto fail;
        if (what != 0 && (v = lt_value_obj(x)) == NULL) {
            Py_XDECREF(k);
            goto fail;
        }
        if ((item = map_item(what, k, v)) == NULL)
            goto fail;
        PyList_SET_ITEM(out, i++, item);
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyObject *lt_keys(LearnedTable *m, PyObject *u) { return lt_list(m, 0, -1); }
static PyObject *lt_values(LearnedTable *m, PyObject *u) { return lt_list(m, 1, -1); }
static PyObject *lt_items(LearnedTable *m, PyObject *u) { return lt_list(m, 2, -1); }

static PyObject *
lt_oldest(LearnedTable *m, PyObject *arg)
{
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    return lt_list(m, 0, n < 0 ? 0 : n);
}

static PyObject *
lt_iter(LearnedTable *m)
{
    PyObject *keys = lt_list(m, 0, -1);
    if (keys == NULL)
        return NULL;
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

static PyObject *
lt_nbytes(LearnedTable *m, PyObject *u)
{
    if (m->dict != NULL) {
        /* the dict, its key ints and its values as the Python side counts them */
        PyObject *sz = PyObject_CallMethod(m->dict, "__sizeof__", NULL);
        if (sz == NULL)
            return NULL;
        size_t b = sizeof(LearnedTable) + PyLong_AsSize_t(sz) + (size_t)PyDict_GET_SIZE(m->dict) * 64;
        Py_DECREF(sz);
        return PyLong_FromSize_t(b);
    }
    size_t b = sizeof(LearnedTable) + (size_t)m->cap * sizeof(LEntry) + ((size_t)m->slot_mask + 1) * sizeof(uint32_t) +
               (m->old.slot ? ((size_t)m->old.mask + 1) * sizeof(uint32_t) : 0);
    return PyLong_FromSize_t(b);
}

/* growth_stats() -> {moved_max, rehashes, rehashing, mig_step, compact_max, compactions,
 * compacting} (for tests) */
static PyObject *
lt_py_growth_stats(LearnedTable *m, PyObject *unused)
{
    return Py_BuildValue("{sKsKsisIsKsKsi}", "moved_max", m->moved_max, "rehashes", m->rehashes, "rehashing",
                         m->old.slot != NULL, "mig_step", m->mig_step, "compact_max", m->comp_max,
                         "compactions", m->compactions, "compacting", (int)m->comp_on);
}

static PyObject *
lt_is_dict(LearnedTable *m, PyObject *u)
{
    return PyBool_FromLong(m->dict != NULL);
}

static PyMethodDef lt_methods[] = {
    {"get", (PyCFunction)(void (*)(void))lt_get, METH_FASTCALL, "get(key, default=None)"},
    {"update", (PyCFunction)lt_update, METH_O, "update(pairs): (key, value) pairs or a dict"},
    {"keys", (PyCFunction)lt_keys, METH_NOARGS, "keys, oldest first"},
    {"values", (PyCFunction)lt_values, METH_NOARGS, "values, oldest key first"},
    {"items", (PyCFunction)lt_items, METH_NOARGS, "(key, value), oldest first"},
    {"oldest", (PyCFunction)lt_oldest, METH_O, "oldest(n) -> the n oldest keys"},
    {"nbytes", (PyCFunction)lt_nbytes, METH_NOARGS, "bytes held"},
    {"is_dict", (PyCFunction)lt_is_dict, METH_NOARGS, "True once a key that cannot be inline turned it into a dict"},
    {"growth_stats", (PyCFunction)lt_py_growth_stats, METH_NOARGS, "how growth moved entries (for tests)"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods lt_as_sequence = {
    .sq_contains = (objobjproc)lt_contains,
};

static PyMappingMethods lt_as_mapping = {
    .mp_length = (lenfunc)lt_py_len,
    .mp_subscript = (binaryfunc)lt_subscript,
    .mp_ass_subscript = (objobjargproc)lt_setitem,
};

static PyTypeObject LearnedTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "consumers._fastpath.LearnedTable",
    .tp_basicsize = sizeof(LearnedTable),
    .tp_dealloc = (destructor)lt_dealloc,
    .tp_as_sequence = &lt_as_sequence,
    .tp_as_mapping = &lt_as_mapping,
    .tp_iter = (getiterfunc)lt_iter,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "engine block hash -> router key, dict semantics, ints stored inline",
    .tp_traverse = (traverseproc)lt_traverse,
    .tp_clear = (inquiry)lt_clear,
    .tp_methods = lt_methods,
    .tp_new = lt_new,
};

