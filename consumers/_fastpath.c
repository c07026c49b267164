/* consumers._fastpath: the router's ingest and key hashing in C.
 *
 * Optional: consumers/_accel.py loads it when it was built (pip install builds it where a C
 * compiler is present) and it passes a self-check; otherwise the router runs in pure Python.
 *
 * Two functions:
 *
 * chain_keys(tokens, parent, block_size) -> list[int]
 *     The router's chained request keys (consumers/keys.py): for every full block of
 *     block_size tokens, key = hash((key, hash(block_tuple))) & (2**60 - 1), bit for bit what
 *     the pure-Python chain computes (CPython's int and tuple hashes, recomputed here: the
 *     import-time self-check compares both on sample inputs and refuses this module if they
 *     ever differ).
 *
 * apply(payload, contexts, stamp, tally) -> None | result
 *     Parses a KVEventBatch msgpack payload (the current map encoding), checks the whole
 *     batch first (anything this parser is not sure msgspec would decode the same way sends the
 *     whole batch back to Python, before anything was changed), takes the endpoint's context
 *     from `contexts` (built by consumers.nativeingest.NativeIngestor) and applies the events
 *     exactly as consumers/ingest.py's inline paths do: GPU stores of canonical blocks, offload
 *     stores that join one key per hash, removals of one key per hash, evicting the oldest
 *     keys when over the entry budget. It stops at the first event that needs the general
 *     Python path and returns what it did (counts added to the caller's tally buffer, where it
 *     stopped, what changed on the endpoint); it never calls back into Python.
 *
 * Sources, one translation unit: the headers listed below, each one role, included here only
 * (tests/test_architecture.py checks that no header includes another).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>

/* u64 from a Python int: PyLong_AsUnsignedLong is a digit loop where unsigned long has 64
 * bits; PyLong_AsUnsignedLongLong goes through a byte-array conversion (several times slower) */
#if ULONG_MAX == 0xFFFFFFFFFFFFFFFFULL
#define AS_U64(o) ((uint64_t)PyLong_AsUnsignedLong(o))
#else
#define AS_U64(o) ((uint64_t)PyLong_AsUnsignedLongLong(o))
#endif

/* Every header of the module, one role each, in the order they build on each other (no header
 * includes another): */
#include "_oa.h"               /* open addressing, shared by both tables */
#include "_masktable_core.h"   /* MaskTable: its layout */
#include "_masktable_grow.h"   /*   its growth (segments, incremental rehash) */
#include "_masktable.h"        /*   its lookups and bit operations */
#include "_masktable_map.h"    /*   its Python mapping interface */
#include "_masktable_ops.h"    /*   its Python index operations and type */
#include "_learned.h"          /* LearnedTable: engine hash -> router key */
#include "_learned_py.h"       /*   its Python methods and type */
#include "_fp_hash.h"          /* CPython's int and tuple hashes, chain_keys */
#include "_fp_parse.h"         /* the KVEventBatch msgpack parser */
#include "_fp_apply.h"         /* applying parsed events to the tables */
#include "_fp_score_keys.h"    /* a prompt's keys from a buffer of token ids */
#include "_fp_score_walk.h"    /* the score's walk over the MaskTable */
#include "_fp_score_plan.h"    /* the Scorer's plan and one endpoint's tiers from the walk */
#include "_fp_score_pods.h"    /* score_pods: KVRouter.score's Scores */
#include "_fp_json_request.h"  /* json_request, json_tokens: the score request's JSON read */
#include "_fp_score_answer.h"  /* score_json: the /v1/score answer's JSON written */

/* apply(payload, contexts, stamp, tally) -> None | (status, next, block_size, token_mask, rank,
 *                                                   left, rest_from, rest_to)
 *
 * contexts: rank -> the endpoint's context tuple (NativeIngestor.context), used while its
 * stamp equals `stamp`; tally: a writable array('q') of TALLY_SLOTS slots the counts are added
 * to (the NativeIngestor folds them into its RouterStats). status 0: every event applied (a
 * result only when the endpoint's block size or token tiers changed); 2: the same, and the
 * learned map is over its budget; 1: events before `next` applied, the `left` events after
 * them (bytes rest_from..rest_to of the payload) need the Python path; 3: not a batch this
 * parser takes, nothing changed; 4: no current context for `rank`, nothing changed.
 *
 * apply_impl's make_ctx (ingest's path): instead of answering 4, it calls
 * make_ctx(pod, rank, model) for a fresh context, stores it in contexts[rank] and goes on with
 * the events it parsed (a stale context costs no second parse). */
static PyObject *str_touch;

static PyObject *
apply_impl(PyObject *payload, PyObject *contexts, PyObject *stamp, PyObject *tally_obj, PyObject *make_ctx,
           PyObject *pod, PyObject *model)
{
    Py_buffer buf, tb;
    if (PyObject_GetBuffer(payload, &buf, PyBUF_SIMPLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(tally_obj, &tb, PyBUF_WRITABLE | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&buf);
        return NULL;
    }
    PyObject *result = NULL;
    PyObject *t = NULL;
    Ev stack_evs[MAX_EVENTS_ON_STACK];
    Ev *evs = stack_evs;
    if (tb.len < (Py_ssize_t)(T_N * sizeof(int64_t)) || tb.itemsize != 8 || tb.format == NULL ||
        strcmp(tb.format, "q") != 0) {
        PyErr_SetString(PyExc_TypeError, "apply: tally must be an array('q') of TALLY_SLOTS slots");
        goto done;
    }
    if (!PyDict_Check(contexts)) {
        PyErr_SetString(PyExc_TypeError, "apply: contexts must be a dict");
        goto done;
    }
    int64_t *tally = (int64_t *)tb.buf;
    Rd r = {(const uint8_t *)buf.buf, (const uint8_t *)buf.buf + buf.len};
    /* --- check the whole batch before touching anything */
    int64_t top = rd_container(&r, 0);
    int64_t nev = -1;
    if (top == 2 || top == 3) {
        if (NEED(&r, 1) && (*r.p == 0xcb || *r.p == 0xca)) {
            size_t w = *r.p == 0xcb ? 9 : 5;
            if (NEED(&r, w)) {
                r.p += w;
                nev = rd_container(&r, 0);
            }
        }
    }
    if (nev < 0)
        goto to_python;
    if (nev > MAX_EVENTS_ON_STACK) {
        if ((uint64_t)nev > (uint64_t)(r.end - r.p)) /* each event takes at least one byte */
            goto to_python;
        evs = PyMem_Malloc(sizeof(Ev) * (size_t)nev);
        if (evs == NULL) {
            PyErr_NoMemory();
            goto done;
        }
    }
    for (int64_t i = 0; i < nev; i++)
        if (!parse_event(&r, &evs[i]))
            goto to_python;
    const uint8_t *events_end = r.p; /* (the rank follows) */
    int64_t rank_v = 0;
    if (top == 3 && !rd_nil(&r)) {
        uint64_t u;
        int64_t sv;
        int k = rd_int(&r, &u, &sv);
        if (k <= 0 || (k == 1 && u > (uint64_t)INT64_MAX))
            goto to_python;
        rank_v = k == 1 ? (int64_t)u : sv;
    }
    if (r.p != r.end)
        goto to_python; /* trailing bytes: the typed decoder rejects them */

    /* --- the endpoint's context (keyed by the rank, None counting as 0), while current */
    PyObject *rank = PyLong_FromLongLong(rank_v);
    if (rank == NULL)
        goto done;
    t = PyDict_GetItemWithError(contexts, rank);
    int current = 0;
    if (t != NULL && PyTuple_Check(t) && PyTuple_GET_SIZE(t) == CTX_LEN) {
        current = PyObject_RichCompareBool(PyTuple_GET_ITEM(t, 0), stamp, Py_EQ);
        if (current < 0) {
            t = NULL;
            Py_DECREF(rank);
            goto done;
        }
    }
    if (!current) {
        t = NULL;
        if (PyErr_Occurred() || make_ctx == NULL) {
            if (!PyErr_Occurred())
                result = Py_BuildValue("(iLLKLLnn)", 4, 0LL, 0LL, 0ULL, (long long)rank_v, 0LL, (Py_ssize_t)0,
                                       (Py_ssize_t)0);
            Py_DECREF(rank);
            goto done;
        }
        /* a fresh context from the ingestor, then on with the events parsed above */
        t = PyObject_CallFunctionObjArgs(make_ctx, pod, rank, model, NULL);
        if (t == NULL || PyDict_SetItem(contexts, rank, t) < 0) {
            Py_DECREF(rank);
            goto done;
        }
    } else {
        Py_INCREF(t);
    }
    Py_DECREF(rank);
    Ctx c;
    if (ctx_from(t, &c) < 0)
        goto done;
    Py_ssize_t learned0 = lt_len(c.lmap);
    int status = 0;
    int64_t i = 0;
    if (c.lmap->dict == NULL)
        prefetch_batch(&c, evs, i, nev);
    for (; i < nev; i++) {
        Ev *ev = &evs[i];
        int rc = 0;
        if (ev->type == EV_CLEARED) {
            rc = SLOW;
        } else if (ev->ignored_group) {
            c.ignored++;
        } else {
            int tier = tier_of(&c, ev->medium, ev->medium_len);
            if (tier < 0)
                rc = SLOW;
            else if (ev->type == EV_REMOVED)
                rc = apply_removed(&c, ev, tier);
            else if (ev->n_toks) {
                if (ev->block_size == c.C && ev->n_hashes && (int64_t)ev->n_toks == (int64_t)ev->n_hashes * c.C)
                    rc = apply_stored_gpu(&c, ev, tier);
                else
                    rc = SLOW;
            } else
                rc = apply_stored_offload(&c, ev, tier);
        }
        if (rc == ERR)
            goto done;
        if (rc == SLOW) {
            status = SLOW;
            break;
        }
        c.events++;
        /* over the entry budget: evict the oldest keys down to the low-water mark, here */
        if (ev->type == EV_STORED && !ev->ignored_group && bookkeeping_due(&c) &&
            mt_evict_to(c.table, c.low_water, NULL, &c.evicted_keys, &c.evicted_entries) < 0)
            goto done;
    }
    result = finish(status, i, &c, lt_len(c.lmap) - learned0, tally, (long long)rank_v, nev - i,
                    i < nev ? evs[i].start - (const uint8_t *)buf.buf : 0,
                    i < nev ? events_end - (const uint8_t *)buf.buf : 0);
    goto done;

to_python:
    /* the whole batch needs the Python decoder; nothing was changed */
    result = Py_BuildValue("(iLLKLLnn)", 3, 0LL, 0LL, 0ULL, 0LL, 0LL, (Py_ssize_t)0, (Py_ssize_t)0);
done:
    Py_XDECREF(t);
    if (evs != stack_evs)
        PyMem_Free(evs);
    PyBuffer_Release(&tb);
    PyBuffer_Release(&buf);
    return result;
}

static PyObject *
py_apply(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "apply(payload, contexts, stamp, tally)");
        return NULL;
    }
    return apply_impl(args[0], args[1], args[2], args[3], NULL, NULL, NULL);
}


/* ingest(by_pod, endpoints, pending_by_hash, pending, tally, finish, expire, context, pod, payload,
 * *, model=None, strict=False): NativeIngestor.apply_payload, bound per ingestor with
 * functools.partial so a batch that applies entirely in C costs no Python frame. It hands C's
 * result to `finish(pod, payload, model, strict, result)` (result None: offloads wait for their
 * GPU events, the whole batch goes to the Python path), asks `context(pod, rank, model)` for a
 * fresh endpoint context where the cached one is stale, and calls `expire()` while joins are
 * pending: all three are the NativeIngestor's own methods; nothing here reads a router. */
static PyObject *
py_ingest(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *model = Py_None, *strict = Py_False;
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    if (nargs < 10 || nargs > 12) {
        PyErr_SetString(PyExc_TypeError, "apply_payload(pod, payload, *, model=None, strict=False)");
        return NULL;
    }
    if (nargs > 10)
        model = args[10];
    if (nargs > 11)
        strict = args[11];
    for (Py_ssize_t i = 0; i < nkw; i++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, i);
        if (PyUnicode_CompareWithASCIIString(name, "model") == 0)
            model = args[nargs + i];
        else if (PyUnicode_CompareWithASCIIString(name, "strict") == 0)
            strict = args[nargs + i];
        else {
            PyErr_Format(PyExc_TypeError, "apply_payload() got an unexpected keyword argument '%U'", name);
            return NULL;
        }
    }
    PyObject *by_pod = args[0], *eps = args[1], *pending_by_hash = args[2], *pending = args[3], *tally = args[4];
    PyObject *fin = args[5], *expire = args[6], *make_ctx = args[7], *pod = args[8], *payload = args[9];
    if (!PyDict_Check(by_pod)) {
        PyErr_SetString(PyExc_TypeError, "apply_payload: contexts must be a dict");
        return NULL;
    }
    int held = PyObject_IsTrue(pending_by_hash);
    if (held < 0)
        return NULL;
    if (held) /* offloads waiting for their GPU events: the Python path resolves them */
        return PyObject_CallFunctionObjArgs(fin, pod, payload, model, strict, Py_None, NULL);
    PyObject *contexts = PyDict_GetItemWithError(by_pod, pod);
    if (contexts == NULL) {
        if (PyErr_Occurred())
            return NULL;
        contexts = PyDict_New();
        if (contexts == NULL || PyDict_SetItem(by_pod, pod, contexts) < 0) {
            Py_XDECREF(contexts);
            return NULL;
        }
        Py_DECREF(contexts); /* by_pod holds it */
    }
    PyObject *stamp = PyObject_GetAttr(eps, str_touch);
    if (stamp == NULL)
        return NULL;
    PyObject *out = apply_impl(payload, contexts, stamp, tally, make_ctx, pod, model);
    Py_DECREF(stamp);
    if (out == NULL)
        return NULL;
    if (out != Py_None) {
        PyObject *r = PyObject_CallFunctionObjArgs(fin, pod, payload, model, strict, out, NULL);
        Py_DECREF(out);
        if (r == NULL)
            return NULL;
        Py_DECREF(r);
    } else {
        Py_DECREF(out);
    }
    int waiting = PyObject_IsTrue(pending);
    if (waiting < 0)
        return NULL;
    if (waiting)
        return PyObject_CallNoArgs(expire);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"chain_keys", py_chain_keys, METH_VARARGS, "Chained router keys of every full block (see consumers.keys)."},
    {"apply", (PyCFunction)(void (*)(void))py_apply, METH_FASTCALL,
     "apply(payload, contexts, stamp, tally): a KVEventBatch payload's common events (consumers.nativeingest)."},
    {"ingest", (PyCFunction)(void (*)(void))py_ingest, METH_FASTCALL | METH_KEYWORDS,
     "NativeIngestor.apply_payload: bind with functools.partial(ingest, by_pod, endpoints, pending_by_hash, "
     "pending, tally, finish, expire, context)."},
    {"json_tokens", py_json_tokens, METH_O, "json_tokens(raw) -> array('I') | None (see _fp_json_request.h)."},
    {"score_pods", (PyCFunction)(void (*)(void))py_score_pods, METH_FASTCALL, "Scorer.score's answer in one call (see _fp_score_pods.h)."},
    {"json_request", py_json_request, METH_O, "json_request(body) -> (model, lora_name, tokens) | None (see _fp_json_request.h)."},
    {"score_json", (PyCFunction)(void (*)(void))py_score_json, METH_FASTCALL, "The /v1/score answer as JSON in one call (see _fp_score_answer.h)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "consumers._fastpath", "The router's ingest and key hashing in C.", -1, methods,
};

PyMODINIT_FUNC
PyInit__fastpath(void)
{
    if (PyType_Ready(&MaskTableType) < 0 || PyType_Ready(&LearnedTableType) < 0)
        return NULL;
    if (str_touch == NULL && (str_touch = PyUnicode_InternFromString("touch")) == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "TALLY_SLOTS", T_N) < 0 || PyModule_AddIntConstant(m, "MAX_STAGES", ST_MAX) < 0 ||
        PyModule_AddObjectRef(m, "MaskTable", (PyObject *)&MaskTableType) < 0 ||
        PyModule_AddObjectRef(m, "LearnedTable", (PyObject *)&LearnedTableType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
