/* _fp_score_answer.h: the service's hot route in C, bytes out (included by _fp_score_pods.h,
 * after _fp_score_json.h, whose json_request reads the request).
 *
 * score_json(table, tokens, parent, block_size, plan, model) -> (answer, top_tiers) | None
 *     score_pods with no load (every pod's load 0.0), written straight to the JSON answer of
 *     /v1/score: {"model", "prompt_tokens", "pick", "pods": [Score...]} with the pods sorted
 *     by (-total, load, pod) and each Score's fields in the Struct's order; the same totals
 *     bit for bit (the same float arithmetic in the same order). top_tiers: the pick's
 *     tokens_by_tier as a dict (for the router's counters), or None without a pick. None when
 *     the plan has a pod, state, rank or factor of a type this writer does not know (the
 *     caller then takes score_pods + msgspec).
 */

/* ------------------------------------------------------------------ the JSON writer */

typedef struct {
    char *p;
    size_t n, cap;
    int err;
} JBuf;

static void
jb_put(JBuf *j, const char *s, size_t n)
{
    if (j->err)
        return;
    if (j->n + n > j->cap) {
        size_t cap = j->cap ? j->cap : 4096;
        while (cap < j->n + n)
            cap *= 2;
        char *q = PyMem_Realloc(j->p, cap);
        if (q == NULL) {
            j->err = 1;
            return;
        }
        j->p = q;
        j->cap = cap;
    }
    memcpy(j->p + j->n, s, n);
    j->n += n;
}

#define JB_LIT(j, s) jb_put((j), (s), sizeof(s) - 1)

/* a str as a JSON string (quotes, backslashes and controls escaped; the rest as UTF-8) */
static void
jb_str(JBuf *j, PyObject *s)
{
    Py_ssize_t n;
    const char *u = PyUnicode_AsUTF8AndSize(s, &n);
    if (u == NULL) {
        PyErr_Clear();
        j->err = 1;
        return;
    }
    JB_LIT(j, "\"");
    Py_ssize_t run = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)u[i];
        if (c >= 0x20 && c != '"' && c != '\\')
            continue;
        jb_put(j, u + run, (size_t)(i - run));
        char esc[8];
        snprintf(esc, sizeof esc, c == '"' ? "\\\"" : c == '\\' ? "\\\\" : "\\u%04x", c);
        jb_put(j, esc, strlen(esc));
        run = i + 1;
    }
    jb_put(j, u + run, (size_t)(n - run));
    JB_LIT(j, "\"");
}

static void
jb_long(JBuf *j, long long v)
{
    char s[24], *q = s + sizeof s;
    unsigned long long u = v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;
    do {
        *--q = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (v < 0)
        *--q = '-';
    jb_put(j, q, (size_t)(s + sizeof s - q));
}

/* a float as msgspec writes one: the shortest repr (Python's), null when not finite */
static void
jb_double(JBuf *j, double v)
{
    if (!isfinite(v)) {
        JB_LIT(j, "null");
        return;
    }
    if (v == 0.0) { /* most pods' totals and every load: no repr needed */
        if (signbit(v))
            JB_LIT(j, "-0.0");
        else
            JB_LIT(j, "0.0");
        return;
    }
    if (v == 1.0) {
        JB_LIT(j, "1.0");
        return;
    }
    char *s = PyOS_double_to_string(v, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
    if (s == NULL) {
        PyErr_Clear();
        j->err = 1;
        return;
    }
    jb_put(j, s, strlen(s));
    PyMem_Free(s);
}

/* ------------------------------------------------------------------ score_json */

typedef struct {
    PyObject *pod, *rank, *state, *factor_o; /* borrowed from the plan */
    const char *name;
    Py_ssize_t name_len;
    PodTiers t;
} PodAns;

static int
podans_cmp(const void *a, const void *b)
{
    const PodAns *x = *(PodAns *const *)a, *y = *(PodAns *const *)b;
    if (x->t.total != y->t.total)
        return x->t.total > y->t.total ? -1 : 1; /* higher total first (loads are all 0.0) */
    Py_ssize_t m = x->name_len < y->name_len ? x->name_len : y->name_len;
    int c = memcmp(x->name, y->name, (size_t)m); /* UTF-8 order is code point order (str's <) */
    return c ? c : (x->name_len > y->name_len) - (x->name_len < y->name_len);
}

static PyObject *
py_score_json(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "score_json(table, tokens, parent, block_size, plan, model)");
        return NULL;
    }
    PyObject *model = args[5];
    if (!PyUnicode_Check(model)) {
        PyErr_SetString(PyExc_TypeError, "score_json: model must be a str");
        return NULL;
    }
    Plan p;
    if (plan_open(&p, args, "score_json") < 0)
        return NULL;
    PyObject *names = p.names;
    Py_ssize_t nrows = p.nrows, n_tok = p.n_tok;
    PodAns *ans = NULL;
    PodAns **best = NULL, **order = NULL; /* best: per pod index; order: the pods in first-seen order */
    JBuf j = {NULL, 0, 0, 0};
    PyObject *result = NULL, *top_tiers = NULL;
    const double pod_load = 0.0;
    size_t cnt = nrows ? (size_t)nrows : 1;
    ans = PyMem_Calloc(cnt, sizeof(PodAns));
    best = PyMem_Calloc(cnt, sizeof(PodAns *));
    order = PyMem_Calloc(cnt, sizeof(PodAns *));
    if (ans == NULL || best == NULL || order == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    size_t npods = 0;
    for (Py_ssize_t r = 0; r < nrows; r++) {
        long slot;
        Py_ssize_t pi;
        double factor;
        PyObject *row = plan_row(&p, r, "score_json", &slot, &pi, &factor);
        if (row == NULL)
            goto fail;
        PodAns *a = &ans[r];
        a->pod = PyTuple_GET_ITEM(row, 1);
        a->rank = PyTuple_GET_ITEM(row, 2);
        a->state = PyTuple_GET_ITEM(row, 3);
        a->factor_o = PyTuple_GET_ITEM(row, 4);
        /* only what this writer writes like msgspec: exact str pod/state, int rank, float factor */
        if (!PyUnicode_CheckExact(a->pod) || !PyUnicode_CheckExact(a->state) || !PyLong_CheckExact(a->rank) ||
            !PyFloat_CheckExact(a->factor_o))
            goto unknown;
        a->name = PyUnicode_AsUTF8AndSize(a->pod, &a->name_len);
        if (a->name == NULL || plan_pod(&p, slot, factor, pod_load, &a->t) < 0)
            goto fail;
        /* keep the pod's best rank: replace if prev is None or total > prev.total */
        if (best[pi] == NULL)
            order[npods++] = best[pi] = a;
        else if (a->t.total > best[pi]->t.total) {
            for (size_t q = 0; q < npods; q++)
                if (order[q] == best[pi])
                    order[q] = a;
            best[pi] = a;
        }
    }
    qsort(order, npods, sizeof(PodAns *), podans_cmp);
    JB_LIT(&j, "{\"model\":");
    jb_str(&j, model);
    JB_LIT(&j, ",\"prompt_tokens\":");
    jb_long(&j, (long long)n_tok);
    JB_LIT(&j, ",\"pick\":");
    if (npods)
        jb_str(&j, order[0]->pod);
    else
        JB_LIT(&j, "null");
    JB_LIT(&j, ",\"pods\":[");
    for (size_t q = 0; q < npods; q++) {
        PodAns *a = order[q];
        if (q)
            JB_LIT(&j, ",");
        JB_LIT(&j, "{\"pod\":");
        jb_str(&j, a->pod);
        JB_LIT(&j, ",\"total\":");
        jb_double(&j, a->t.total);
        JB_LIT(&j, ",\"tokens_by_tier\":{");
        for (uint32_t t = 0; t < a->t.ntier; t++) {
            if (t)
                JB_LIT(&j, ",");
            jb_str(&j, PyTuple_GET_ITEM(names, a->t.tier[t]));
            JB_LIT(&j, ":");
            jb_long(&j, a->t.toks[t]);
        }
        JB_LIT(&j, "},\"matched_tokens\":");
        jb_long(&j, a->t.matched);
        JB_LIT(&j, ",\"rank\":");
        long long rank = PyLong_AsLongLong(a->rank);
        if (rank == -1 && PyErr_Occurred())
            goto fail;
        jb_long(&j, rank);
        JB_LIT(&j, ",\"state\":");
        jb_str(&j, a->state);
        JB_LIT(&j, ",\"factor\":");
        jb_double(&j, PyFloat_AS_DOUBLE(a->factor_o));
        JB_LIT(&j, ",\"load\":");
        jb_double(&j, pod_load);
        JB_LIT(&j, "}");
    }
    JB_LIT(&j, "]}");
    if (j.err) /* a str that is not UTF-8 (lone surrogates), or no memory: the Python path answers */
        goto unknown;
    if (npods && (top_tiers = plan_tiers_dict(&p, &order[0]->t)) == NULL)
        goto fail;
    PyObject *bytes = PyBytes_FromStringAndSize(j.p, (Py_ssize_t)j.n);
    if (bytes != NULL)
        result = Py_BuildValue("(NO)", bytes, top_tiers ? top_tiers : Py_None);
    goto fail;
unknown:
    result = Py_NewRef(Py_None);
fail:
    Py_XDECREF(top_tiers);
    PyMem_Free(j.p);
    PyMem_Free(ans);
    PyMem_Free(best);
    PyMem_Free(order);
    plan_close(&p);
    return result;
}
