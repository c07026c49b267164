/* _fp_hash.h: CPython's int and tuple hashes, recomputed, and chain_keys.
 * Included by _fastpath.c (one extension module, one translation unit). */
/* ------------------------------------------------------------------ CPython's hashes */

#define HMOD ((uint64_t)0x1FFFFFFFFFFFFFFFULL) /* 2**61 - 1: CPython's modulus for int hashes */
#define XXP1 ((uint64_t)11400714785074694791ULL)
#define XXP2 ((uint64_t)14029467366897019727ULL)
#define XXP5 ((uint64_t)2870177450012600261ULL)
#define KEY_MASK ((uint64_t)0x0FFFFFFFFFFFFFFFULL) /* 2**60 - 1 */

/* v mod 2**61 - 1 without a division: 2**61 = 1 (mod 2**61 - 1), so fold the top 3 bits in;
 * the sum is below 2 * (2**61 - 1), so one subtraction finishes it */
static inline uint64_t
mod_p61(uint64_t v)
{
    uint64_t r = (v & HMOD) + (v >> 61);
    return r >= HMOD ? r - HMOD : r;
}

static inline int64_t
int_hash_u(uint64_t v)
{
    return (int64_t)mod_p61(v);
}

static inline int64_t
int_hash_s(int64_t v)
{
    if (v >= 0)
        return (int64_t)mod_p61((uint64_t)v);
    uint64_t mag = (uint64_t)0 - (uint64_t)v;
    int64_t h = -(int64_t)mod_p61(mag);
    return h == -1 ? -2 : h;
}

static inline uint64_t
lane_mix(uint64_t acc, int64_t lane)
{
    acc += (uint64_t)lane * XXP2;
    acc = (acc << 31) | (acc >> 33);
    return acc * XXP1;
}

static inline int64_t
tuple_end(uint64_t acc, uint64_t len)
{
    acc += len ^ (XXP5 ^ 3527539ULL);
    if (acc == (uint64_t)-1)
        return 1546275796;
    return (int64_t)acc;
}

/* key of the block after the key whose hash is `prev_lane`, for content hash `content`
 * (a key is < 2**60, so its hash is itself) */
static inline uint64_t
chain_step_lane(int64_t prev_lane, int64_t content)
{
    uint64_t acc = lane_mix(XXP5, prev_lane);
    acc = lane_mix(acc, int_hash_s(content));
    return (uint64_t)tuple_end(acc, 2) & KEY_MASK;
}

static inline uint64_t
chain_step(uint64_t prev, int64_t content)
{
    return chain_step_lane(int_hash_u(prev), content);
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

static PyObject *
py_chain_keys(PyObject *self, PyObject *args)
{
    PyObject *tokens, *parent;
    Py_ssize_t bs;
    if (!PyArg_ParseTuple(args, "OOn:chain_keys", &tokens, &parent, &bs))
        return NULL;
    Py_hash_t parent_lane = PyObject_Hash(parent); /* any int parent, as the Python chain takes it */
    if (parent_lane == -1 && PyErr_Occurred())
        return NULL;
    if (bs <= 0) {
        PyErr_Format(PyExc_ValueError, "block_size must be > 0, got %zd", bs);
        return NULL;
    }
    PyObject *seq = PySequence_Fast(tokens, "tokens must be a sequence of ints");
    if (seq == NULL)
        return NULL;
    Py_ssize_t nblocks = PySequence_Fast_GET_SIZE(seq) / bs;
    uint64_t small[64];
    uint64_t *keys = nblocks <= 64 ? small : PyMem_Malloc((size_t)nblocks * sizeof(uint64_t));
    PyObject *out = NULL;
    if (keys == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (keys_of_items(PySequence_Fast_ITEMS(seq), bs, (int64_t)parent_lane, keys, nblocks) < 0)
        goto done;
    out = PyList_New(nblocks);
    for (Py_ssize_t b = 0; out != NULL && b < nblocks; b++) {
        PyObject *key = PyLong_FromUnsignedLongLong(keys[b]);
        if (key == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, b, key);
    }
done:
    if (keys != small)
        PyMem_Free(keys);
    Py_DECREF(seq);
    return out;
}

