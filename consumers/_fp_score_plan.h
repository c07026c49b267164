/* _fp_score_plan.h: what score_pods and score_json (_fp_score_pods.h, _fp_score_answer.h)
 * share: the Scorer's plan unpacked and the walk done (_fp_score_walk.h), and one endpoint's
 * tokens by tier, weighted total and matched tokens from the walk, with Scorer.score's float
 * arithmetic in its order (so the same totals bit for bit).
 *
 * plan: (lanes, start, rows, names, weights, float(load_weight), score_type, block_size, then
 * score_json's JSON fragments and packed rows), built by consumers.scorer once per endpoint
 * plan; rows: (slot, pod, rank, state, factor, pod_index) of every endpoint taking part.
 */

#define PLAN_LEN 12 /* score_pods reads the first 8; score_json the JSON fragments and packed rows too */

/* One call's plan, unpacked, with the walk done: what score_pods and score_json share. */
typedef struct {
    Walk w;
    PyObject *rows, *names, *score_type; /* borrowed from the plan */
    Py_ssize_t nrows, n_tok;
    double lw;
    double n_tokens;   /* max(len(tokens), 1) as a float */
    long C;            /* block size */
    double wt[ST_MAX]; /* per stage: its tier's weight */
} Plan;

/* One endpoint's answer from the walk: tokens by tier name (names in a dict's first-insertion
 * order), weighted total and matched tokens, with Scorer.score's float arithmetic in its order
 * (so the same totals bit for bit). */
typedef struct {
    double total;
    long long matched;
    uint32_t ntier;
    uint32_t tier[ST_MAX]; /* the stage whose name comes first */
    long long toks[ST_MAX];
} PodTiers;

/* args: (table, tokens, parent, block_size, plan, ...): unpack the plan and walk. 0, or -1 with
 * an exception (nothing to free); after 0, plan_close(p). fn names the caller in errors. */
static int
plan_open(Plan *p, PyObject *const *args, const char *fn)
{
    PyObject *plan = args[4];
    if (!PyTuple_Check(plan) || PyTuple_GET_SIZE(plan) != PLAN_LEN) {
        PyErr_Format(PyExc_TypeError, "%s: plan must be the Scorer's plan tuple", fn);
        return -1;
    }
    p->rows = PyTuple_GET_ITEM(plan, 2);
    p->names = PyTuple_GET_ITEM(plan, 3);
    p->score_type = PyTuple_GET_ITEM(plan, 6);
    PyObject *weights = PyTuple_GET_ITEM(plan, 4);
    p->lw = PyFloat_AsDouble(PyTuple_GET_ITEM(plan, 5));
    p->C = PyLong_AsLong(PyTuple_GET_ITEM(plan, 7));
    if (PyErr_Occurred())
        return -1;
    if (!PyTuple_Check(p->rows) || !PyTuple_Check(p->names) || !PyTuple_Check(weights) ||
        PyTuple_GET_SIZE(weights) != PyTuple_GET_SIZE(p->names)) {
        PyErr_Format(PyExc_TypeError, "%s: malformed plan", fn);
        return -1;
    }
    p->nrows = PyTuple_GET_SIZE(p->rows);
    PyObject *wargs[6] = {args[0], args[1], args[2], args[3], PyTuple_GET_ITEM(plan, 0), PyTuple_GET_ITEM(plan, 1)};
    if (walk_all(&p->w, wargs) < 0)
        goto fail;
    if (p->w.T > (uint32_t)PyTuple_GET_SIZE(p->names)) {
        PyErr_Format(PyExc_ValueError, "%s: fewer tier names than lanes", fn);
        goto fail;
    }
    for (uint32_t s = 0; s < p->w.T; s++)
        if ((p->wt[s] = PyFloat_AsDouble(PyTuple_GET_ITEM(weights, s))) == -1.0 && PyErr_Occurred())
            goto fail;
    if (PyList_Check(args[1]) || PyTuple_Check(args[1]))
        p->n_tok = PySequence_Fast_GET_SIZE(args[1]);
    else if ((p->n_tok = PyObject_Length(args[1])) < 0)
        goto fail;
    p->n_tokens = p->n_tok > 1 ? (double)p->n_tok : 1.0;
    return 0;
fail:
    walk_free(&p->w);
    return -1;
}

static inline void
plan_close(Plan *p)
{
    walk_free(&p->w);
}

/* row r of the plan: (slot, pod, rank, state, factor, pod_index), checked; *slot, *pi, *factor.
 * The row (borrowed), or NULL with an exception */
static inline __attribute__((always_inline)) PyObject *
plan_row(const Plan *p, Py_ssize_t r, const char *fn, long *slot, Py_ssize_t *pi, double *factor)
{
    PyObject *row = PyTuple_GET_ITEM(p->rows, r);
    if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != 6) {
        PyErr_Format(PyExc_TypeError, "%s: a row is (slot, pod, rank, state, factor, pod_index)", fn);
        return NULL;
    }
    *slot = PyLong_AsLong(PyTuple_GET_ITEM(row, 0));
    *pi = PyLong_AsSsize_t(PyTuple_GET_ITEM(row, 5));
    *factor = PyFloat_AsDouble(PyTuple_GET_ITEM(row, 4));
    if (PyErr_Occurred())
        return NULL;
    if (*slot < 0 || (uint32_t)*slot >= p->w.nslots || *pi < 0 || *pi >= p->nrows) {
        PyErr_Format(PyExc_ValueError, "%s: a row's slot or pod index is out of range", fn);
        return NULL;
    }
    return row;
}

/* the endpoint at walk slot `slot`: its PodTiers with this factor and pod load. 0, or -1 with
 * an exception (a tier name that cannot be compared) */
static inline __attribute__((always_inline)) int
plan_pod(const Plan *p, long slot, double factor, double pod_load, PodTiers *a)
{
    const Walk *w = &p->w;
    a->ntier = 0;
    a->matched = 0;
    uint32_t ns = w->nseg[slot];
    if (!ns) {
        a->total = 0.0 - p->lw * pod_load; /* as Scorer.score: never -0.0 */
        return 0;
    }
    int32_t end = w->endv[slot] >= 0 ? w->endv[slot] : (int32_t)w->n;
    double weighted = 0.0;
    for (uint32_t q = 0; q < ns; q++) {
        SegEv ev = w->segs[slot * w->T + q];
        int32_t last = q + 1 < ns ? w->segs[slot * w->T + q + 1].first : end;
        if (last <= ev.first)
            continue;
        /* by_tier[name] += tokens, names kept in first-insertion order (a dict's) */
        PyObject *name = PyTuple_GET_ITEM(p->names, ev.stage);
        uint32_t t = 0;
        while (t < a->ntier && PyUnicode_Compare(PyTuple_GET_ITEM(p->names, a->tier[t]), name) != 0)
            t++;
        if (PyErr_Occurred())
            return -1;
        if (t == a->ntier) {
            a->tier[a->ntier++] = (uint32_t)ev.stage;
            a->toks[t] = 0;
        }
        a->toks[t] += (long long)(last - ev.first) * p->C;
        weighted += p->wt[ev.stage] * (double)(last - ev.first) * (double)p->C;
    }
    a->total = factor * weighted / p->n_tokens - p->lw * pod_load;
    a->matched = (long long)end * p->C;
    return 0;
}

/* a PodTiers' tokens by tier as a dict {name: tokens} (a new reference, or NULL) */
static PyObject *
plan_tiers_dict(const Plan *p, const PodTiers *a)
{
    PyObject *d = PyDict_New();
    for (uint32_t t = 0; d != NULL && t < a->ntier; t++) {
        PyObject *v = PyLong_FromLongLong(a->toks[t]);
        if (v == NULL || PyDict_SetItem(d, PyTuple_GET_ITEM(p->names, a->tier[t]), v) < 0)
            Py_CLEAR(d);
        Py_XDECREF(v);
    }
    return d;
}
