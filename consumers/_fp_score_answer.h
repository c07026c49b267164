/* _fp_score_answer.h: the service's hot route in C, bytes out (the request is read by
 * _fp_json_request.h; the walk and the per-endpoint tiers are _fp_score_plan.h's).
 *
 * score_json(table, tokens, parent, block_size, plan, model_json, load) -> (answer, top_tiers)
 *     score_pods written straight to the JSON answer of /v1/score: {"model", "prompt_tokens",
 *     "pick", "pods": [Score...]} with the pods sorted by (-total, load, pod) and each Score's
 *     fields in the Struct's order; load: None or a dict pod -> number, as score_pods's; the same totals
 *     bit for bit (the same float arithmetic in the same order) and the same bytes as msgspec
 *     writes. model_json: the model as a JSON string (bytes, msgspec's). What only the plan
 *     decides comes written from it (consumers.scorer._json_plan: per row the pod's JSON
 *     string and its Score's text before the total and from matched_tokens' end to "load":,
 *     per stage the tier's "name":, the pods in name order, the rows' slot, pod index and
 *     factor packed); this call writes the numbers between them.
 *     top_tiers: the pick's tokens_by_tier as a dict (for the router's counters), or None
 *     without a pick.
 */

/* ------------------------------------------------------------------ numbers as msgspec writes them */

/* v in decimal at q; the end */
static inline char *
jw_long(char *q, long long v)
{
    char s[24], *e = s + sizeof s, *d = e;
    unsigned long long u = v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;
    do {
        *--d = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (v < 0)
        *--d = '-';
    memcpy(q, d, (size_t)(e - d));
    return q + (e - d);
}

#define JW_DOUBLE_MAX 32

/* a float as msgspec writes one (at most JW_DOUBLE_MAX bytes): null when not finite, else the
 * shortest digits that read back the same (Python's repr's), in fixed notation for decimal
 * exponents -5..15 and otherwise as d[.ddd]e[-]x (no '+', no leading zeros: 1e22, 1.5e-7).
 * Python's repr differs from that only at exponent -5 (1e-05 where msgspec writes 0.00001) and
 * in the exponent's '+' and zeros. The end, or NULL (no memory) */
static char *
jw_double(char *q, double v)
{
    if (!isfinite(v)) {
        memcpy(q, "null", 4);
        return q + 4;
    }
    if (v == 0.0) { /* most pods' totals and every load: no repr needed */
        if (signbit(v)) {
            memcpy(q, "-0.0", 4);
            return q + 4;
        }
        memcpy(q, "0.0", 3);
        return q + 3;
    }
    if (v == 1.0) {
        memcpy(q, "1.0", 3);
        return q + 3;
    }
    char *s = PyOS_double_to_string(v, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
    if (s == NULL)
        return NULL;
    char *e = strchr(s, 'e');
    if (e == NULL) {
        size_t n = strlen(s);
        memcpy(q, s, n);
        q += n;
    } else {
        int x = atoi(e + 1);
        const char *m = s;
        if (*m == '-')
            *q++ = *m++;
        if (x == -5) { /* d[.ddd]e-05 -> 0.0000d[ddd] */
            memcpy(q, "0.0000", 6);
            q += 6;
            for (; m < e; m++)
                if (*m != '.')
                    *q++ = *m;
        } else {
            memcpy(q, m, (size_t)(e - m));
            q += e - m;
            *q++ = 'e';
            q = jw_long(q, x);
        }
    }
    PyMem_Free(s);
    return q;
}

/* ------------------------------------------------------------------ score_json */

/* a plan row as score_json reads it: consumers.scorer._json_plan packs (slot, pod index,
 * factor) with struct format "=iid" (native order, no padding: this layout) */
typedef struct {
    int32_t slot, pi;
    double factor;
} PackedRow;

typedef struct {
    PyObject *frag;  /* (pod's JSON string, text before total, text after matched_tokens): borrowed */
    uint32_t byname; /* the pod's place in name order */
    double load;
    PodTiers t;
} PodAns;

/* x goes before y in the answer: (-total, load, pod) */
static inline int
podans_before(const PodAns *x, const PodAns *y)
{
    if (x->t.total != y->t.total)
        return x->t.total > y->t.total;
    if (x->load != y->load)
        return x->load < y->load;
    return x->byname < y->byname;
}

static int
podans_cmp(const void *a, const void *b)
{
    const PodAns *x = *(PodAns *const *)a, *y = *(PodAns *const *)b;
    return podans_before(x, y) ? -1 : podans_before(y, x) ? 1 : 0;
}

/* the pods in name order -> sorted by (-total, load, name). Most pods of an answer share a
 * total (0.0: nothing matched) and a load, so an insertion sort moves only the few that
 * matched; past 64 pods, qsort (the same order: no two pods compare equal) bounds the worst
 * case. */
static void
podans_sort(PodAns **order, size_t n)
{
    if (n > 64) {
        qsort(order, n, sizeof(PodAns *), podans_cmp);
        return;
    }
    for (size_t i = 1; i < n; i++) {
        PodAns *x = order[i];
        size_t j = i;
        while (j > 0 && podans_before(x, order[j - 1])) {
            order[j] = order[j - 1];
            j--;
        }
        order[j] = x;
    }
}

#define JW_LIT(q, s) (memcpy((q), (s), sizeof(s) - 1), (q) += sizeof(s) - 1)
#define JW_BYTES(q, o) (memcpy((q), PyBytes_AS_STRING(o), (size_t)PyBytes_GET_SIZE(o)), (q) += PyBytes_GET_SIZE(o))
#define ANS_STACK 128

static PyObject *
py_score_json(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "score_json(table, tokens, parent, block_size, plan, model_json, load)");
        return NULL;
    }
    PyObject *model = args[5], *load = args[6];
    if (!PyBytes_Check(model)) {
        PyErr_SetString(PyExc_TypeError, "score_json: model_json must be bytes (the model as a JSON string)");
        return NULL;
    }
    if (load != Py_None && !PyDict_Check(load)) {
        PyErr_SetString(PyExc_TypeError, "score_json: load must be None or a dict");
        return NULL;
    }
    Plan p;
    if (plan_open(&p, args, "score_json") < 0)
        return NULL;
    PyObject *plan = args[4];
    PyObject *frags = PyTuple_GET_ITEM(plan, 8), *tier_frags = PyTuple_GET_ITEM(plan, 9),
             *byname = PyTuple_GET_ITEM(plan, 10), *rows_packed = PyTuple_GET_ITEM(plan, 11);
    Py_ssize_t nrows = p.nrows;
    PodAns stack_ans[ANS_STACK], *ans = stack_ans;
    PodAns *stack_best[ANS_STACK], **best = stack_best; /* per pod index: its best rank's answer */
    PodAns *stack_order[ANS_STACK], **order = stack_order;
    PyObject *result = NULL, *top_tiers = NULL, *out = NULL;
    if (!PyTuple_Check(frags) || PyTuple_GET_SIZE(frags) != nrows || !PyBytes_Check(rows_packed) ||
        PyBytes_GET_SIZE(rows_packed) != nrows * (Py_ssize_t)sizeof(PackedRow) || !PyTuple_Check(tier_frags) ||
        PyTuple_GET_SIZE(tier_frags) < (Py_ssize_t)p.w.T || !PyBytes_Check(byname) ||
        PyBytes_GET_SIZE(byname) > nrows * (Py_ssize_t)sizeof(uint32_t) || PyBytes_GET_SIZE(byname) % sizeof(uint32_t)) {
        PyErr_SetString(PyExc_TypeError, "score_json: malformed plan (JSON fragments)");
        goto done;
    }
    for (uint32_t s = 0; s < p.w.T; s++)
        if (!PyBytes_Check(PyTuple_GET_ITEM(tier_frags, s))) {
            PyErr_SetString(PyExc_TypeError, "score_json: malformed plan (tier fragments)");
            goto done;
        }
    if (nrows > ANS_STACK) {
        ans = PyMem_Malloc((size_t)nrows * sizeof(PodAns));
        best = PyMem_Malloc((size_t)nrows * sizeof(PodAns *));
        order = PyMem_Malloc((size_t)nrows * sizeof(PodAns *));
        if (ans == NULL || best == NULL || order == NULL) {
            PyErr_NoMemory();
            goto done;
        }
    }
    memset(best, 0, (size_t)nrows * sizeof(PodAns *));
    const char *packed = PyBytes_AS_STRING(rows_packed);
    for (Py_ssize_t r = 0; r < nrows; r++) {
        PackedRow row;
        memcpy(&row, packed + r * sizeof(PackedRow), sizeof(PackedRow));
        if (row.slot < 0 || (uint32_t)row.slot >= p.w.nslots || row.pi < 0 || row.pi >= nrows) {
            PyErr_SetString(PyExc_ValueError, "score_json: a row's slot or pod index is out of range");
            goto done;
        }
        long slot = row.slot;
        Py_ssize_t pi = row.pi;
        double factor = row.factor;
        PodAns *a = &ans[r];
        a->frag = PyTuple_GET_ITEM(frags, r);
        if (!PyTuple_Check(a->frag) || PyTuple_GET_SIZE(a->frag) != 3 || !PyBytes_Check(PyTuple_GET_ITEM(a->frag, 0)) ||
            !PyBytes_Check(PyTuple_GET_ITEM(a->frag, 1)) || !PyBytes_Check(PyTuple_GET_ITEM(a->frag, 2))) {
            PyErr_SetString(PyExc_TypeError, "score_json: malformed plan (a row's fragments)");
            goto done;
        }
        a->load = 0.0;
        if (load != Py_None) { /* pod_load = float(load.get(pod, 0.0)) */
            PyObject *row_t = PyTuple_GET_ITEM(p.rows, r);
            if (!PyTuple_Check(row_t) || PyTuple_GET_SIZE(row_t) != 6) {
                PyErr_SetString(PyExc_TypeError, "score_json: a row is (slot, pod, rank, state, factor, pod_index)");
                goto done;
            }
            PyObject *lv = PyDict_GetItemWithError(load, PyTuple_GET_ITEM(row_t, 1));
            if (lv == NULL && PyErr_Occurred())
                goto done;
            if (lv != NULL) {
                PyObject *lf = PyNumber_Float(lv);
                if (lf == NULL)
                    goto done;
                a->load = PyFloat_AS_DOUBLE(lf);
                Py_DECREF(lf);
            }
        }
        if (plan_pod(&p, slot, factor, a->load, &a->t) < 0)
            goto done;
        /* keep the pod's best rank: replace if prev is None or total > prev.total */
        if (best[pi] == NULL || a->t.total > best[pi]->t.total)
            best[pi] = a;
    }
    /* the pods in name order, then by total */
    const uint32_t *names_order = (const uint32_t *)PyBytes_AS_STRING(byname);
    size_t npods = 0, cap = 128 + (size_t)PyBytes_GET_SIZE(model);
    size_t tier_max = 0;
    for (uint32_t s = 0; s < p.w.T; s++)
        if ((size_t)PyBytes_GET_SIZE(PyTuple_GET_ITEM(tier_frags, s)) > tier_max)
            tier_max = (size_t)PyBytes_GET_SIZE(PyTuple_GET_ITEM(tier_frags, s));
    for (Py_ssize_t q = 0; q < PyBytes_GET_SIZE(byname) / (Py_ssize_t)sizeof(uint32_t); q++) {
        uint32_t pi = names_order[q];
        if (pi >= (uint32_t)nrows) {
            PyErr_SetString(PyExc_ValueError, "score_json: a pod index out of range in the plan");
            goto done;
        }
        PodAns *a = best[pi];
        if (a == NULL)
            continue;
        a->byname = (uint32_t)npods;
        order[npods++] = a;
        cap += (size_t)PyBytes_GET_SIZE(PyTuple_GET_ITEM(a->frag, 1)) + (size_t)PyBytes_GET_SIZE(PyTuple_GET_ITEM(a->frag, 2)) +
               64 + 2 * JW_DOUBLE_MAX + a->t.ntier * (tier_max + 24);
    }
    podans_sort(order, npods);
    if (npods)
        cap += (size_t)PyBytes_GET_SIZE(PyTuple_GET_ITEM(order[0]->frag, 0));
    out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)cap);
    if (out == NULL)
        goto done;
    char *q = PyBytes_AS_STRING(out);
    JW_LIT(q, "{\"model\":");
    JW_BYTES(q, model);
    JW_LIT(q, ",\"prompt_tokens\":");
    q = jw_long(q, (long long)p.n_tok);
    JW_LIT(q, ",\"pick\":");
    if (npods)
        JW_BYTES(q, PyTuple_GET_ITEM(order[0]->frag, 0));
    else
        JW_LIT(q, "null");
    JW_LIT(q, ",\"pods\":[");
    for (size_t k = 0; k < npods; k++) {
        PodAns *a = order[k];
        if (k)
            *q++ = ',';
        JW_BYTES(q, PyTuple_GET_ITEM(a->frag, 1));
        if ((q = jw_double(q, a->t.total)) == NULL)
            goto done;
        JW_LIT(q, ",\"tokens_by_tier\":{");
        for (uint32_t t = 0; t < a->t.ntier; t++) {
            if (t)
                *q++ = ',';
            JW_BYTES(q, PyTuple_GET_ITEM(tier_frags, a->t.tier[t]));
            q = jw_long(q, a->t.toks[t]);
        }
        JW_LIT(q, "},\"matched_tokens\":");
        q = jw_long(q, a->t.matched);
        JW_BYTES(q, PyTuple_GET_ITEM(a->frag, 2));
        if (a->load == 0.0 && !signbit(a->load)) /* no load given for the pod: most answers' every pod */
            JW_LIT(q, "0.0");
        else if ((q = jw_double(q, a->load)) == NULL)
            goto done;
        *q++ = '}';
    }
    JW_LIT(q, "]}");
    if (_PyBytes_Resize(&out, q - PyBytes_AS_STRING(out)) < 0)
        goto done; /* out is NULL then */
    if (npods && (top_tiers = plan_tiers_dict(&p, &order[0]->t)) == NULL)
        goto done;
    result = PyTuple_Pack(2, out, top_tiers ? top_tiers : Py_None);
done:
    Py_XDECREF(out);
    Py_XDECREF(top_tiers);
    if (ans != stack_ans)
        PyMem_Free(ans);
    if (best != stack_best)
        PyMem_Free(best);
    if (order != stack_order)
        PyMem_Free(order);
    plan_close(&p);
    return result;
}
