/* _fp_score_pods.h: KVRouter.score's answer in C over the native index.
 *
 * score_pods(table, tokens, parent, block_size, plan, load) -> (out, top)
 *     The walk and the per-endpoint tiers of _fp_score_plan.h, then per endpoint its Score,
 *     the best rank per pod kept, and the pick (THE tie-break of consumers.score.better):
 *     the Scores of consumers.scorer's Python loop, float for float. load: None or a dict
 *     pod -> number.
 */

/* ------------------------------------------------------------------ score_pods */

static PyObject *
py_score_pods(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "score_pods(table, tokens, parent, block_size, plan, load)");
        return NULL;
    }
    PyObject *load = args[5];
    if (load != Py_None && !PyDict_Check(load)) {
        PyErr_SetString(PyExc_TypeError, "score_pods: load must be None or a dict");
        return NULL;
    }
    Plan p;
    if (plan_open(&p, args, "score_pods") < 0)
        return NULL;
    Py_ssize_t nrows = p.nrows;
    PyObject *out = NULL, *result = NULL, *top = NULL, *zero_f = NULL;
    PyObject **best = NULL;  /* per pod index: its Score in `out` (borrowed) */
    /* top: the pick so far (a reference of its own: `out` may replace it) */
    double *best_total = NULL;
    double top_total = 0, top_load = 0;
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
        long slot;
        Py_ssize_t pi;
        double factor;
        PyObject *row = plan_row(&p, r, "score_pods", &slot, &pi, &factor);
        if (row == NULL)
            goto fail;
        PyObject *pod = PyTuple_GET_ITEM(row, 1), *factor_o = PyTuple_GET_ITEM(row, 4);
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
        PodTiers a;
        if (plan_pod(&p, slot, factor, pod_load, &a) < 0) {
            Py_DECREF(load_f);
            goto fail;
        }
        double total = a.total;
        /* keep the pod's best rank: out[pod] = Score(...) if prev is None or total > prev.total */
        if (best[pi] != NULL && !(total > best_total[pi])) {
            Py_DECREF(load_f);
            continue;
        }
        PyObject *by_tier = plan_tiers_dict(&p, &a);
        PyObject *total_o = PyFloat_FromDouble(total), *matched_o = PyLong_FromLongLong(a.matched);
        PyObject *sargs[8] = {pod, total_o, by_tier, matched_o, PyTuple_GET_ITEM(row, 2), PyTuple_GET_ITEM(row, 3),
                              factor_o, load_f};
        PyObject *sc = by_tier && total_o && matched_o ? PyObject_Vectorcall(p.score_type, sargs, 8, NULL) : NULL;
        Py_XDECREF(total_o);
        Py_XDECREF(matched_o);
        Py_XDECREF(by_tier);
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
    plan_close(&p);
    return result;
}
