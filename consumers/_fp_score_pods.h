/* _fp_score_pods.h: the API-facing end of scoring in C (included by _fp_score.h).
 *
 * json_tokens(raw) -> array('I') | None
 *     The token ids of a JSON array of non-negative ints below 2**32 (the text msgspec.Raw
 *     keeps of a request's "token_ids", already checked to be JSON by msgspec), without one
 *     Python int per token. None for anything else (floats, negatives, too big, not an
 *     array): the caller decodes those with msgspec, which names what is wrong and where.
 *
 * score_pods(table, tokens, parent, block_size, plan, load) -> (out, top)
 *     Scorer.score's answer for the native index in one call: the walk of _fp_score.h, then
 *     per endpoint its tokens by tier, weighted total and Score, the best rank per pod kept,
 *     and the pick (THE tie-break of consumers.score.better), with the same float arithmetic
 *     in the same order as the Python loop (so the same totals, bit for bit).
 *     plan: (lanes, start, rows, names, weights, float(load_weight), float(-load_weight),
 *     score_type, block_size) built by
 *     the Scorer once per endpoint plan; rows: (slot, pod, rank, state, factor, pod_index) of
 *     every endpoint taking part; load: None or a dict pod -> number.
 */

static PyObject *array_type; /* array.array, imported on first use */

/* ------------------------------------------------------------------ json_tokens */

static inline const char *
skip_ws(const char *p, const char *end)
{
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r'))
        p++;
    return p;
}

static PyObject *
py_json_tokens(PyObject *self, PyObject *raw)
{
    Py_buffer b;
    if (PyObject_GetBuffer(raw, &b, PyBUF_SIMPLE) < 0)
        return NULL;
    const char *p = b.buf, *end = p + b.len;
    PyObject *res = NULL;
    uint32_t *out = NULL;
    size_t n = 0;
    p = skip_ws(p, end);
    while (end > p && (end[-1] == ' ' || end[-1] == '\t' || end[-1] == '\n' || end[-1] == '\r'))
        end--;
    /* '[' ... ']' with the ']' last: the digit loops below stop at it without a bound check */
    if (end - p < 2 || *p != '[' || end[-1] != ']')
        goto other;
    out = PyMem_Malloc(((size_t)(end - p) / 2 + 1) * sizeof(uint32_t)); /* each int takes >= 2 chars */
    if (out == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    p = skip_ws(p + 1, end);
    if (*p != ']') {
        for (;;) {
            const char *d0 = p;
            uint64_t v = 0;
            unsigned c;
            while ((c = (unsigned)(unsigned char)*p - '0') <= 9) {
                v = v * 10 + c;
                p++;
            }
            if (p == d0 || p - d0 > 10 || v >> 32 || *p == '.' || *p == 'e' || *p == 'E')
                goto other; /* not a digit ('-', a string, null...), too big, a float */
            out[n++] = (uint32_t)v;
            if (*p != ',' && *p != ']')
                p = skip_ws(p, end);
            if (*p == ',') {
                p++;
                if (*p == ' ')
                    p++;
                else
                    p = skip_ws(p, end);
                continue;
            }
            if (*p == ']')
                break;
            goto other;
        }
    }
    if (p != end - 1)
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
    PyMem_Free(out);
    PyBuffer_Release(&b);
    return res;
}

/* ------------------------------------------------------------------ score_pods */

#define PLAN_LEN 9

static PyObject *
py_score_pods(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "score_pods(table, tokens, parent, block_size, plan, load)");
        return NULL;
    }
    PyObject *plan = args[4], *load = args[5];
    if (!PyTuple_Check(plan) || PyTuple_GET_SIZE(plan) != PLAN_LEN) {
        PyErr_SetString(PyExc_TypeError, "score_pods: plan must be the Scorer's plan tuple");
        return NULL;
    }
    if (load != Py_None && !PyDict_Check(load)) {
        PyErr_SetString(PyExc_TypeError, "score_pods: load must be None or a dict");
        return NULL;
    }
    PyObject *rows = PyTuple_GET_ITEM(plan, 2), *names = PyTuple_GET_ITEM(plan, 3);
    PyObject *weights = PyTuple_GET_ITEM(plan, 4), *score_type = PyTuple_GET_ITEM(plan, 7);
    /* -load_weight is negated where load_weight is (an int 0 negates to 0, a float 0.0 to -0.0) */
    double lw = PyFloat_AsDouble(PyTuple_GET_ITEM(plan, 5)), neg_lw = PyFloat_AsDouble(PyTuple_GET_ITEM(plan, 6));
    long C = PyLong_AsLong(PyTuple_GET_ITEM(plan, 8));
    if (PyErr_Occurred())
        return NULL;
    if (!PyTuple_Check(rows) || !PyTuple_Check(names) || !PyTuple_Check(weights) ||
        PyTuple_GET_SIZE(weights) != PyTuple_GET_SIZE(names)) {
        PyErr_SetString(PyExc_TypeError, "score_pods: malformed plan");
        return NULL;
    }
    PyObject *wargs[6] = {args[0], args[1], args[2], args[3], PyTuple_GET_ITEM(plan, 0), PyTuple_GET_ITEM(plan, 1)};
    Walk w;
    Py_ssize_t nrows = PyTuple_GET_SIZE(rows);
    PyObject *out = NULL, *result = NULL, *top = NULL, *zero_f = NULL;
    PyObject **best = NULL;  /* per pod index: its Score in `out` (borrowed) */
    /* top: the pick so far (a reference of its own: `out` may replace it) */
    double *best_total = NULL;
    double top_total = 0, top_load = 0;
    if (walk_all(&w, wargs) < 0)
        goto fail;
    if (w.T > (uint32_t)PyTuple_GET_SIZE(names)) {
        PyErr_SetString(PyExc_ValueError, "score_pods: fewer tier names than lanes");
        goto fail;
    }
    double wt[ST_MAX];
    for (uint32_t s = 0; s < w.T; s++)
        if ((wt[s] = PyFloat_AsDouble(PyTuple_GET_ITEM(weights, s))) == -1.0 && PyErr_Occurred())
            goto fail;
    Py_ssize_t n_tok = 0;
    if (PyList_Check(args[1]) || PyTuple_Check(args[1]))
        n_tok = PySequence_Fast_GET_SIZE(args[1]);
    else if ((n_tok = PyObject_Length(args[1])) < 0)
        goto fail;
    double n_tokens = n_tok > 1 ? (double)n_tok : 1.0;
    out = PyDict_New();
    best = PyMem_Calloc(nrows ? nrows : 1, sizeof(PyObject *));
    best_total = PyMem_Calloc(nrows ? nrows : 1, sizeof(double));
    zero_f = PyFloat_FromDouble(0.0);
    if (out == NULL || best == NULL || best_total == NULL || zero_f == NULL) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t r = 0; r < nrows; r++) {
        PyObject *row = PyTuple_GET_ITEM(rows, r);
        if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != 6) {
            PyErr_SetString(PyExc_TypeError, "score_pods: a row is (slot, pod, rank, state, factor, pod_index)");
            goto fail;
        }
        long slot = PyLong_AsLong(PyTuple_GET_ITEM(row, 0));
        Py_ssize_t pi = PyLong_AsSsize_t(PyTuple_GET_ITEM(row, 5));
        PyObject *pod = PyTuple_GET_ITEM(row, 1), *factor_o = PyTuple_GET_ITEM(row, 4);
        double factor = PyFloat_AsDouble(factor_o);
        if (PyErr_Occurred())
            goto fail;
        if (slot < 0 || (uint32_t)slot >= w.nslots || pi < 0 || pi >= nrows) {
            PyErr_SetString(PyExc_ValueError, "score_pods: a row's slot or pod index is out of range");
            goto fail;
        }
        /* pod_load = float(load.get(pod, 0.0)) */
        PyObject *load_f;
        if (load == Py_None) {
            load_f = Py_NewRef(zero_f);
        } else {
            PyObject *lv = PyDict_GetItemWithError(load, pod);
            if (lv == NULL && PyErr_Occurred())
                goto fail;
            load_f = lv == NULL ? Py_NewRef(zero_f) : PyNumber_Float(lv);
            if (load_f == NULL)
                goto fail;
        }
        double pod_load = PyFloat_AS_DOUBLE(load_f);
        PyObject *by_tier = PyDict_New();
        if (by_tier == NULL) {
            Py_DECREF(load_f);
            goto fail;
        }
        double total;
        long matched = 0;
        uint32_t ns = w.nseg[slot];
        if (!ns) {
            total = neg_lw * pod_load;
        } else {
            int32_t end = w.endv[slot] >= 0 ? w.endv[slot] : (int32_t)w.n;
            double weighted = 0.0;
            for (uint32_t q = 0; q < ns; q++) {
                SegEv ev = w.segs[slot * w.T + q];
                int32_t last = q + 1 < ns ? w.segs[slot * w.T + q + 1].first : end;
                if (last <= ev.first)
                    continue;
                long toks = (long)(last - ev.first) * C;
                PyObject *name = PyTuple_GET_ITEM(names, ev.stage);
                PyObject *had = PyDict_GetItemWithError(by_tier, name);
                long sum = toks;
                if (had != NULL)
                    sum += PyLong_AsLong(had);
                PyObject *sv = PyErr_Occurred() ? NULL : PyLong_FromLong(sum);
                if (sv == NULL || PyDict_SetItem(by_tier, name, sv) < 0) {
                    Py_XDECREF(sv);
                    Py_DECREF(by_tier);
                    Py_DECREF(load_f);
                    goto fail;
                }
                Py_DECREF(sv);
                weighted += wt[ev.stage] * (double)(last - ev.first) * (double)C;
            }
            total = factor * weighted / n_tokens - lw * pod_load;
            matched = (long)end * C;
        }
        /* keep the pod's best rank: out[pod] = Score(...) if prev is None or total > prev.total */
        if (best[pi] != NULL && !(total > best_total[pi])) {
            Py_DECREF(by_tier);
            Py_DECREF(load_f);
            continue;
        }
        PyObject *total_o = PyFloat_FromDouble(total), *matched_o = PyLong_FromLong(matched);
        PyObject *sargs[8] = {pod, total_o, by_tier, matched_o, PyTuple_GET_ITEM(row, 2), PyTuple_GET_ITEM(row, 3),
                              factor_o, load_f};
        PyObject *sc = total_o && matched_o ? PyObject_Vectorcall(score_type, sargs, 8, NULL) : NULL;
        Py_XDECREF(total_o);
        Py_XDECREF(matched_o);
        Py_DECREF(by_tier);
        Py_DECREF(load_f);
        if (sc == NULL)
            goto fail;
        int rc = PyDict_SetItem(out, pod, sc);
        Py_DECREF(sc); /* `out` holds it */
        if (rc < 0)
            goto fail;
        best[pi] = sc;
        best_total[pi] = total;
        /* better(s, top): a higher total, then a lower load, then the pod name */
        int win = top == NULL || total > top_total;
        if (!win && total == top_total) {
            if (pod_load < top_load)
                win = 1;
            else if (pod_load == top_load) {
                PyObject *tp = PyObject_GetAttrString(top, "pod");
                if (tp == NULL)
                    goto fail;
                win = PyObject_RichCompareBool(pod, tp, Py_LT);
                Py_DECREF(tp);
                if (win < 0)
                    goto fail;
            }
        }
        if (win) {
            Py_XSETREF(top, Py_NewRef(sc));
            top_total = total;
            top_load = pod_load;
        }
    }
    result = PyTuple_Pack(2, out, top ? top : Py_None);
fail:
    Py_XDECREF(top);
    Py_XDECREF(out);
    Py_XDECREF(zero_f);
    PyMem_Free(best);
    PyMem_Free(best_total);
    walk_free(&w);
    return result;
}

#include "_fp_score_json.h"
#include "_fp_score_answer.h"
