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
 * apply(payload, start, ctx_fn, pod, model) -> tuple
 *     Parses a KVEventBatch msgpack payload (the current map encoding), checks the whole
 *     batch first (anything this parser is not sure msgspec would decode the same way sends the
 *     whole batch back to Python, before anything was changed), then asks
 *     ctx_fn(pod, model, rank) for the endpoint's context and applies events from index
 *     `start` on, exactly as consumers/ingest.py's inline paths do: GPU stores of canonical
 *     blocks, offload stores that join one key per hash, and removals of one key per hash.
 *     It stops at the first event that needs the general Python path (status 1) or after an
 *     event whose index bookkeeping must run in Python (compaction, eviction: status 2), and
 *     returns what it did so the caller can account for it and carry on.
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

#include "_masktable.h"
#include "_learned.h"

/* ------------------------------------------------------------------ CPython's hashes */

#define HMOD ((uint64_t)0x1FFFFFFFFFFFFFFFULL) /* 2**61 - 1: CPython's modulus for int hashes */
#define XXP1 ((uint64_t)11400714785074694791ULL)
#define XXP2 ((uint64_t)14029467366897019727ULL)
#define XXP5 ((uint64_t)2870177450012600261ULL)
#define KEY_MASK ((uint64_t)0x0FFFFFFFFFFFFFFFULL) /* 2**60 - 1 */

static inline int64_t
int_hash_u(uint64_t v)
{
    return (int64_t)(v % HMOD);
}

static inline int64_t
int_hash_s(int64_t v)
{
    if (v >= 0)
        return (int64_t)((uint64_t)v % HMOD);
    uint64_t mag = (uint64_t)0 - (uint64_t)v;
    int64_t h = -(int64_t)(mag % HMOD);
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
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t nblocks = n / bs;
    PyObject *out = PyList_New(nblocks);
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    uint64_t k = 0;
    for (Py_ssize_t b = 0; b < nblocks; b++) {
        uint64_t acc = XXP5;
        PyObject **it = items + b * bs;
        for (Py_ssize_t j = 0; j < bs; j++) {
            Py_hash_t h = PyObject_Hash(it[j]);
            if (h == -1 && PyErr_Occurred()) {
                Py_DECREF(seq);
                Py_DECREF(out);
                return NULL;
            }
            acc = lane_mix(acc, (int64_t)h);
        }
        k = b ? chain_step(k, tuple_end(acc, (uint64_t)bs))
              : chain_step_lane((int64_t)parent_lane, tuple_end(acc, (uint64_t)bs));
        PyObject *key = PyLong_FromUnsignedLongLong(k);
        if (key == NULL) {
            Py_DECREF(seq);
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, b, key);
    }
    Py_DECREF(seq);
    return out;
}

/* ------------------------------------------------------------------ msgpack reading */

typedef struct {
    const uint8_t *p;
    const uint8_t *end;
} Rd;

#define NEED(r, n) ((size_t)((r)->end - (r)->p) >= (size_t)(n))

static inline uint16_t be16(const uint8_t *p) { return (uint16_t)((p[0] << 8) | p[1]); }
static inline uint32_t be32(const uint8_t *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}
static inline uint64_t be64(const uint8_t *p) { return ((uint64_t)be32(p) << 32) | be32(p + 4); }

/* An integer: returns 1 (unsigned value in *u), 2 (negative value in *s), 0 not an int, -1 truncated */
static inline int
rd_int(Rd *r, uint64_t *u, int64_t *s)
{
    if (!NEED(r, 1))
        return -1;
    uint8_t c = *r->p;
    if (c <= 0x7f) {
        r->p++;
        *u = c;
        return 1;
    }
    if (c >= 0xe0) {
        r->p++;
        *s = (int8_t)c;
        return 2;
    }
    switch (c) {
    case 0xcc:
        if (!NEED(r, 2)) return -1;
        *u = r->p[1]; r->p += 2; return 1;
    case 0xcd:
        if (!NEED(r, 3)) return -1;
        *u = be16(r->p + 1); r->p += 3; return 1;
    case 0xce:
        if (!NEED(r, 5)) return -1;
        *u = be32(r->p + 1); r->p += 5; return 1;
    case 0xcf:
        if (!NEED(r, 9)) return -1;
        *u = be64(r->p + 1); r->p += 9; return 1;
    case 0xd0:
        if (!NEED(r, 2)) return -1;
        *s = (int8_t)r->p[1]; r->p += 2; break;
    case 0xd1:
        if (!NEED(r, 3)) return -1;
        *s = (int16_t)be16(r->p + 1); r->p += 3; break;
    case 0xd2:
        if (!NEED(r, 5)) return -1;
        *s = (int32_t)be32(r->p + 1); r->p += 5; break;
    case 0xd3:
        if (!NEED(r, 9)) return -1;
        *s = (int64_t)be64(r->p + 1); r->p += 9; break;
    default:
        return 0;
    }
    if (*s >= 0) {
        *u = (uint64_t)*s;
        return 1;
    }
    return 2;
}

/* array/map header: returns the count, -1 if not that kind or truncated */
static inline int64_t
rd_container(Rd *r, int want_map)
{
    if (!NEED(r, 1))
        return -1;
    uint8_t c = *r->p;
    uint8_t fix = want_map ? 0x80 : 0x90, h16 = want_map ? 0xde : 0xdc, h32 = want_map ? 0xdf : 0xdd;
    if ((c & 0xf0) == fix) {
        r->p++;
        return c & 0x0f;
    }
    if (c == h16) {
        if (!NEED(r, 3)) return -1;
        int64_t n = be16(r->p + 1);
        r->p += 3;
        return n;
    }
    if (c == h32) {
        if (!NEED(r, 5)) return -1;
        int64_t n = be32(r->p + 1);
        r->p += 5;
        return n;
    }
    return -1;
}

static int
utf8_ok(const uint8_t *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        if (c < 0x80) { i++; continue; }
        size_t len;
        uint32_t cp;
        if ((c & 0xe0) == 0xc0) { len = 2; cp = c & 0x1f; }
        else if ((c & 0xf0) == 0xe0) { len = 3; cp = c & 0x0f; }
        else if ((c & 0xf8) == 0xf0) { len = 4; cp = c & 0x07; }
        else return 0;
        if (i + len > n) return 0;
        for (size_t j = 1; j < len; j++) {
            if ((s[i + j] & 0xc0) != 0x80) return 0;
            cp = (cp << 6) | (s[i + j] & 0x3f);
        }
        if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10ffff)))
            return 0;
        if (cp >= 0xd800 && cp <= 0xdfff) return 0;
        i += len;
    }
    return 1;
}

/* a str: 1 (valid UTF-8; *s, *n set), 0 not a str or not valid UTF-8, -1 truncated */
static inline int
rd_str(Rd *r, const uint8_t **s, size_t *n)
{
    if (!NEED(r, 1))
        return -1;
    uint8_t c = *r->p;
    size_t len, hdr;
    if ((c & 0xe0) == 0xa0) { len = c & 0x1f; hdr = 1; }
    else if (c == 0xd9) { if (!NEED(r, 2)) return -1; len = r->p[1]; hdr = 2; }
    else if (c == 0xda) { if (!NEED(r, 3)) return -1; len = be16(r->p + 1); hdr = 3; }
    else if (c == 0xdb) { if (!NEED(r, 5)) return -1; len = be32(r->p + 1); hdr = 5; }
    else return 0;
    if (!NEED(r, hdr + len))
        return -1;
    *s = r->p + hdr;
    *n = len;
    if (!utf8_ok(*s, len))
        return 0;
    r->p += hdr + len;
    return 1;
}

static inline int
rd_nil(Rd *r)
{
    if (NEED(r, 1) && *r->p == 0xc0) {
        r->p++;
        return 1;
    }
    return 0;
}

/* Skip one value of plain data (what msgspec decodes as Any without surprises): nil, bools,
 * ints, floats, valid str, bin, arrays, maps with str or int keys. Anything else (ext types,
 * deep nesting, truncation) returns 0: the caller hands the batch to Python. */
static int
skip_plain(Rd *r, int depth)
{
    if (depth > 32 || !NEED(r, 1))
        return 0;
    uint8_t c = *r->p;
    uint64_t u;
    int64_t s;
    const uint8_t *str;
    size_t n;
    if (c == 0xc0 || c == 0xc2 || c == 0xc3) { r->p++; return 1; }
    if (c == 0xca) { if (!NEED(r, 5)) return 0; r->p += 5; return 1; }
    if (c == 0xcb) { if (!NEED(r, 9)) return 0; r->p += 9; return 1; }
    if (c <= 0x7f || c >= 0xe0 || (c >= 0xcc && c <= 0xd3))
        return rd_int(r, &u, &s) > 0;
    if ((c & 0xe0) == 0xa0 || (c >= 0xd9 && c <= 0xdb))
        return rd_str(r, &str, &n) == 1;
    if (c >= 0xc4 && c <= 0xc6) {
        size_t hdr = c == 0xc4 ? 2 : c == 0xc5 ? 3 : 5;
        if (!NEED(r, hdr)) return 0;
        size_t len = c == 0xc4 ? r->p[1] : c == 0xc5 ? be16(r->p + 1) : be32(r->p + 1);
        if (!NEED(r, hdr + len)) return 0;
        r->p += hdr + len;
        return 1;
    }
    if ((c & 0xf0) == 0x90 || c == 0xdc || c == 0xdd) {
        int64_t cnt = rd_container(r, 0);
        if (cnt < 0) return 0;
        for (int64_t i = 0; i < cnt; i++)
            if (!skip_plain(r, depth + 1)) return 0;
        return 1;
    }
    if ((c & 0xf0) == 0x80 || c == 0xde || c == 0xdf) {
        int64_t cnt = rd_container(r, 1);
        if (cnt < 0) return 0;
        for (int64_t i = 0; i < cnt; i++) {
            if (!NEED(r, 1)) return 0;
            uint8_t k = *r->p;
            int is_str = (k & 0xe0) == 0xa0 || (k >= 0xd9 && k <= 0xdb);
            int is_int = k <= 0x7f || k >= 0xe0 || (k >= 0xcc && k <= 0xd3);
            if (!(is_str || is_int) || !skip_plain(r, depth + 1) || !skip_plain(r, depth + 1))
                return 0;
        }
        return 1;
    }
    return 0;
}

/* ------------------------------------------------------------------ events */

enum { EV_STORED = 1, EV_REMOVED = 2, EV_CLEARED = 3 };

typedef struct {
    int type;
    int slow;                /* needs the general Python path */
    const uint8_t *hashes;   /* first element of block_hashes (all ints) */
    uint32_t n_hashes;
    int parent_kind;         /* 0 nil, 1 unsigned, 2 negative */
    uint64_t parent_u;
    int64_t parent_s;
    const uint8_t *toks;     /* first element of token_ids (all ints) */
    uint32_t n_toks;
    int64_t block_size;
    int lora;                /* lora_id or lora_name set */
    const uint8_t *medium;   /* NULL: nil */
    size_t medium_len;
    int ignored_group;       /* group_idx not None/0 */
} Ev;

/* field ids */
enum {
    F_TYPE, F_HASHES, F_PARENT, F_TOKS, F_BS, F_LORA_ID, F_MEDIUM, F_LORA_NAME, F_EXTRA, F_GROUP,
    F_SPEC_KIND, F_SPEC_WINDOW, F_LOCALITY, F_OWNERSHIP, F_SESSION, F_LOOKAHEAD, F_UNKNOWN
};

static int
field_id(const uint8_t *s, size_t n)
{
#define IS(lit) (n == sizeof(lit) - 1 && memcmp(s, lit, n) == 0)
    if (IS("type")) return F_TYPE;
    if (IS("block_hashes")) return F_HASHES;
    if (IS("parent_block_hash")) return F_PARENT;
    if (IS("token_ids")) return F_TOKS;
    if (IS("block_size")) return F_BS;
    if (IS("lora_id")) return F_LORA_ID;
    if (IS("medium")) return F_MEDIUM;
    if (IS("lora_name")) return F_LORA_NAME;
    if (IS("extra_keys")) return F_EXTRA;
    if (IS("group_idx")) return F_GROUP;
    if (IS("kv_cache_spec_kind")) return F_SPEC_KIND;
    if (IS("kv_cache_spec_sliding_window")) return F_SPEC_WINDOW;
    if (IS("locality")) return F_LOCALITY;
    if (IS("ownership")) return F_OWNERSHIP;
    if (IS("session_id")) return F_SESSION;
    if (IS("lookahead_token_ids")) return F_LOOKAHEAD;
    return F_UNKNOWN;
#undef IS
}

/* array of ints: count, or -1 (not an array of ints) */
static int64_t
rd_int_array(Rd *r, const uint8_t **first)
{
    int64_t n = rd_container(r, 0);
    if (n < 0)
        return -1;
    *first = r->p;
    uint64_t u;
    int64_t s;
    for (int64_t i = 0; i < n; i++)
        if (rd_int(r, &u, &s) <= 0)
            return -1;
    return n;
}

static int
rd_opt_int(Rd *r, int *is_set, uint64_t *u, int64_t *s)
{
    if (rd_nil(r)) {
        *is_set = 0;
        return 1;
    }
    *is_set = 1;
    return rd_int(r, u, s) > 0;
}

static int
rd_opt_str(Rd *r, const uint8_t **s, size_t *n)
{
    if (rd_nil(r)) {
        *s = NULL;
        *n = 0;
        return 1;
    }
    return rd_str(r, s, n) == 1;
}

/* One event map into *ev. 1: understood (ev->slow may still be set), 0: hand the batch to Python. */
static int
parse_event(Rd *r, Ev *ev)
{
    int64_t nf = rd_container(r, 1);
    if (nf < 0)
        return 0;
    memset(ev, 0, sizeof(*ev));
    uint32_t seen = 0;
    const uint8_t *s;
    size_t n;
    uint64_t u;
    int64_t sv;
    int set;
    for (int64_t i = 0; i < nf; i++) {
        /* a field name: a known one is plain ASCII by construction (no UTF-8 check needed) */
        if (!NEED(r, 1))
            return 0;
        uint8_t h = *r->p;
        int f;
        if ((h & 0xe0) == 0xa0 && NEED(r, 1 + (size_t)(h & 0x1f)) &&
            (f = field_id(r->p + 1, h & 0x1f)) != F_UNKNOWN) {
            r->p += 1 + (h & 0x1f);
        } else {
            if (rd_str(r, &s, &n) != 1)
                return 0;
            f = field_id(s, n);
        }
        if (f != F_UNKNOWN) {
            if (seen & (1u << f))
                return 0; /* duplicate field */
            seen |= 1u << f;
        }
        switch (f) {
        case F_TYPE:
            if (rd_str(r, &s, &n) != 1)
                return 0;
            if (n == 11 && memcmp(s, "BlockStored", 11) == 0) ev->type = EV_STORED;
            else if (n == 12 && memcmp(s, "BlockRemoved", 12) == 0) ev->type = EV_REMOVED;
            else if (n == 16 && memcmp(s, "AllBlocksCleared", 16) == 0) ev->type = EV_CLEARED;
            else return 0;
            break;
        case F_HASHES: {
            int64_t c = rd_int_array(r, &ev->hashes);
            if (c < 0 || c > 0x7fffffff)
                return 0; /* bytes hashes (or anything else): Python */
            ev->n_hashes = (uint32_t)c;
            break;
        }
        case F_PARENT:
            if (rd_nil(r))
                ev->parent_kind = 0;
            else {
                int k = rd_int(r, &ev->parent_u, &ev->parent_s);
                if (k <= 0)
                    return 0;
                ev->parent_kind = k;
            }
            break;
        case F_TOKS: {
            int64_t c = rd_int_array(r, &ev->toks);
            if (c < 0 || c > 0x7fffffff)
                return 0;
            ev->n_toks = (uint32_t)c;
            break;
        }
        case F_BS: {
            int k = rd_int(r, &u, &sv);
            if (k <= 0)
                return 0;
            ev->block_size = k == 1 ? (u > (uint64_t)INT64_MAX ? -1 : (int64_t)u) : sv;
            break;
        }
        case F_LORA_ID:
            if (!rd_opt_int(r, &set, &u, &sv))
                return 0;
            ev->lora |= set;
            break;
        case F_MEDIUM:
            if (!rd_opt_str(r, &ev->medium, &ev->medium_len))
                return 0;
            break;
        case F_LORA_NAME:
            if (!rd_opt_str(r, &s, &n))
                return 0;
            ev->lora |= s != NULL;
            break;
        case F_GROUP:
            if (!rd_nil(r)) {
                int k = rd_int(r, &u, &sv);
                if (k <= 0)
                    return 0;
                ev->ignored_group = !(k == 1 && u == 0); /* indexed groups: None and 0 */
            }
            break;
        case F_SPEC_KIND:
        case F_LOCALITY:
        case F_OWNERSHIP:
        case F_SESSION:
            if (!rd_opt_str(r, &s, &n))
                return 0;
            break;
        case F_SPEC_WINDOW:
            if (!rd_opt_int(r, &set, &u, &sv))
                return 0;
            break;
        case F_EXTRA:
            if (!rd_nil(r)) {
                if (!NEED(r, 1))
                    return 0;
                uint8_t c = *r->p;
                if (!((c & 0xf0) == 0x90 || c == 0xdc || c == 0xdd) || !skip_plain(r, 0))
                    return 0;
            }
            break;
        case F_LOOKAHEAD:
            if (!rd_nil(r)) {
                int64_t c = rd_container(r, 0);
                if (c < 0)
                    return 0;
                const uint8_t *first;
                for (int64_t j = 0; j < c; j++)
                    if (rd_int_array(r, &first) < 0)
                        return 0;
            }
            break;
        default:
            if (!skip_plain(r, 0))
                return 0;
        }
    }
    /* required fields, as the typed decoder wants them; a release that lacked some goes to Python */
    const uint32_t stored_req = (1u << F_TYPE) | (1u << F_HASHES) | (1u << F_PARENT) | (1u << F_TOKS) |
                                (1u << F_BS) | (1u << F_LORA_ID) | (1u << F_MEDIUM) | (1u << F_LORA_NAME);
    const uint32_t stored_ok = stored_req | (1u << F_EXTRA) | (1u << F_GROUP) | (1u << F_SPEC_KIND) |
                               (1u << F_SPEC_WINDOW) | (1u << F_LOCALITY) | (1u << F_OWNERSHIP) |
                               (1u << F_SESSION) | (1u << F_LOOKAHEAD);
    const uint32_t removed_req = (1u << F_TYPE) | (1u << F_HASHES) | (1u << F_MEDIUM);
    const uint32_t removed_ok = removed_req | (1u << F_GROUP) | (1u << F_LOCALITY) | (1u << F_OWNERSHIP);
    switch (ev->type) {
    case EV_STORED:
        return (seen & stored_req) == stored_req && (seen & ~stored_ok) == 0;
    case EV_REMOVED:
        return (seen & removed_req) == removed_req && (seen & ~removed_ok) == 0;
    case EV_CLEARED:
        /* a field of another event type would be rejected by the typed decoder? Python decides */
        return seen == (1u << F_TYPE);
    default:
        return 0;
    }
}

/* ------------------------------------------------------------------ counters */

/* The router's plain-int counters (RouterStats and LearnedMap are slotted classes) are
 * updated in place, through their slots' offsets, found once by bind_counters(). */
enum { K_BATCHES, K_EVENTS, K_STORED, K_OFFLOAD, K_REMOVED, K_UNKNOWN, K_IGNORED, K_LEARNED, K_LEARNED_MAX, K_N };
static const char *counter_names[K_N] = {"batches", "events", "blocks_stored", "offload_blocks", "blocks_removed",
                                         "remove_unknown", "ignored_group_events", "size", "max_size"};
static Py_ssize_t counter_off[K_N];
static PyTypeObject *stats_type, *learned_type;

static PyObject *
py_bind_counters(PyObject *self, PyObject *args)
{
    PyObject *st, *lt;
    if (!PyArg_ParseTuple(args, "O!O!:bind_counters", &PyType_Type, &st, &PyType_Type, &lt))
        return NULL;
    for (int i = 0; i < K_N; i++) {
        PyObject *d = PyObject_GetAttrString(i < K_LEARNED ? st : lt, counter_names[i]);
        if (d == NULL)
            return NULL;
        int ok = Py_TYPE(d) == &PyMemberDescr_Type &&
                 ((PyMemberDescrObject *)d)->d_member->type == T_OBJECT_EX;
        if (ok)
            counter_off[i] = ((PyMemberDescrObject *)d)->d_member->offset;
        Py_DECREF(d);
        if (!ok) {
            PyErr_Format(PyExc_TypeError, "bind_counters: %s is not a slot", counter_names[i]);
            return NULL;
        }
    }
    Py_XSETREF(stats_type, (PyTypeObject *)Py_NewRef(st));
    Py_XSETREF(learned_type, (PyTypeObject *)Py_NewRef(lt));
    Py_RETURN_NONE;
}

static inline PyObject **
counter_slot(PyObject *obj, int k)
{
    return (PyObject **)((char *)obj + counter_off[k]);
}

/* obj.<counter k> += delta; -1 with an exception if the slot does not hold an int */
static int
counter_add(PyObject *obj, int k, long long delta)
{
    if (delta == 0)
        return 0;
    PyObject **slot = counter_slot(obj, k);
    PyObject *old = *slot;
    if (old == NULL || !PyLong_CheckExact(old)) {
        PyErr_Format(PyExc_TypeError, "counter %s does not hold an int", counter_names[k]);
        return -1;
    }
    long long v = PyLong_AsLongLong(old);
    if (v == -1 && PyErr_Occurred())
        return -1;
    PyObject *nv = PyLong_FromLongLong(v + delta);
    if (nv == NULL)
        return -1;
    *slot = nv;
    Py_DECREF(old);
    return 0;
}

/* ------------------------------------------------------------------ applying */

typedef struct {
    /* from the context */
    PyObject *ep, *seed, *odd, *tier_names, *bits, *store_chunk, *remove_one, *stats, *learned;
    LearnedTable *lmap;
    MaskTable *table;
    uint64_t seed_u;
    Py_ssize_t n_tiers;
    int64_t C;
    int64_t block_size, block_size0;
    uint64_t token_tiers, token_tiers0;
    int64_t max_entries;
    /* tallies */
    Py_ssize_t events, blocks_stored, offload_blocks, blocks_removed, remove_unknown, ignored;
} Ctx;

static int
tier_of(Ctx *c, const uint8_t *medium, size_t len)
{
    if (medium == NULL) {
        medium = (const uint8_t *)"GPU";
        len = 3;
    }
    for (Py_ssize_t t = 0; t < c->n_tiers; t++) {
        Py_ssize_t n;
        const char *name = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(c->tier_names, t), &n);
        if (name != NULL && (size_t)n == len && memcmp(name, medium, len) == 0)
            return (int)t;
    }
    PyErr_Clear();
    return -1;
}

#define SLOW 1
#define BOOKKEEP 2
#define ERR -1

static int
bookkeeping_due(Ctx *c)
{
    return c->table->entries > c->max_entries || (int64_t)c->table->n > c->max_entries;
}

static inline uint32_t
bit_of(Ctx *c, int tier)
{
    return (uint32_t)PyLong_AsUnsignedLong(PyTuple_GET_ITEM(c->bits, tier));
}

/* the event's hashes as u64 into out (all non-negative ints, else 0: Python decides) */
static int
hashes_u64(const Ev *ev, uint64_t *out)
{
    const uint8_t *hp = ev->hashes;
    for (uint32_t i = 0; i < ev->n_hashes; i++) {
        Rd r = {hp, hp + 9};
        uint64_t u = 0;
        int64_t sv = 0;
        if (rd_int(&r, &u, &sv) != 1)
            return 0; /* a signed hash: keyed differently in Python, which decides */
        hp = r.p;
        out[i] = u;
    }
    return 1;
}

#define U64_STACK 64

/* overlap the cache misses of n lookups: every slot line first, then every entry line */
static void
prefetch_learned(const LearnedTable *m, const uint64_t *k, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        lt_prefetch_slot(m, k[i]);
    for (Py_ssize_t i = 0; i < n; i++)
        lt_prefetch_entry(m, k[i]);
}

static void
prefetch_masks(const MaskTable *t, const uint64_t *k, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        mt_prefetch_slot(t, k[i]);
    for (Py_ssize_t i = 0; i < n; i++)
        mt_prefetch_entry(t, k[i]);
}

static int
apply_stored_gpu(Ctx *c, Ev *ev, int tier)
{
    Py_ssize_t n = ev->n_hashes;
    uint64_t pv;
    int is_int;
    uint64_t u;
    PyObject *obj;
    if (ev->parent_kind == 0) {
        if (ev->lora)
            return SLOW;
        pv = c->seed_u;
    } else {
        if (ev->parent_kind != 1)
            return SLOW;
        int f = lt_lookup(c->lmap, ev->parent_u, &is_int, &u, &obj);
        if (f < 0)
            return ERR;
        if (f == 0 || !is_int)
            return SLOW; /* orphan or a partial-block parent: the Python path */
        pv = u;
    }
    uint64_t stack[2 * U64_STACK];
    uint64_t *hs = n <= U64_STACK ? stack : PyMem_Malloc(sizeof(uint64_t) * 2 * (size_t)n);
    if (hs == NULL) {
        PyErr_NoMemory();
        return ERR;
    }
    uint64_t *ks = hs + (n <= U64_STACK ? U64_STACK : n);
    int rc = ERR;
    if (!hashes_u64(ev, hs)) {
        rc = SLOW;
        goto out;
    }
    prefetch_learned(c->lmap, hs, n);
    /* already learned (e.g. from another pod): take the keys, no hashing */
    int learned = 0;
    int f = lt_lookup(c->lmap, hs[0], &is_int, &u, &obj);
    if (f < 0)
        goto out;
    if (f == 1) {
        learned = 1;
        for (Py_ssize_t i = 0; i < n; i++) {
            f = lt_lookup(c->lmap, hs[i], &is_int, &u, &obj);
            if (f < 0)
                goto out;
            if (f == 0 || !is_int) {
                learned = 0;
                break;
            }
            ks[i] = u;
        }
    }
    if (!learned) {
        uint64_t k = pv;
        const uint8_t *tp = ev->toks;
        int64_t C = c->C;
        for (Py_ssize_t b = 0; b < n; b++) {
            uint64_t acc = XXP5;
            for (int64_t j = 0; j < C; j++) {
                Rd r = {tp, tp + 9};
                uint64_t tu = 0;
                int64_t ts = 0;
                int kind = rd_int(&r, &tu, &ts);
                tp = r.p;
                acc = lane_mix(acc, kind == 1 ? int_hash_u(tu) : int_hash_s(ts));
            }
            k = chain_step(k, tuple_end(acc, (uint64_t)C));
            ks[b] = k;
        }
        for (Py_ssize_t i = 0; i < n; i++)
            if (lt_set_int(c->lmap, hs[i], ks[i]) < 0)
                goto out;
    }
    c->block_size = c->C;
    c->token_tiers |= (uint64_t)1 << tier;
    c->blocks_stored += n;
    /* index.add_chain(keys, bit, None if no parent else pv) */
    uint32_t bit = bit_of(c, tier);
    prefetch_masks(c->table, ks, n);
    uint64_t prev = ev->parent_kind != 0 ? pv : MT_NOPAR;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (mt_set_bit_parent(c->table, ks[i], bit, prev) < 0)
            goto out;
        prev = ks[i];
    }
    rc = 0;
out:
    if (hs != stack)
        PyMem_Free(hs);
    return rc;
}

static int
apply_stored_offload(Ctx *c, Ev *ev, int tier)
{
    Py_ssize_t n = ev->n_hashes;
    long chunk = PyLong_AsLong(PyTuple_GET_ITEM(c->store_chunk, tier));
    /* 0: one key per hash; 1: one key per hash if the event has at most one hash (else the
     * chunk length is inferred in Python); 2: Python */
    if (chunk == 2 || (chunk == 1 && n > 1))
        return SLOW;
    if (c->block_size != c->C || PyObject_IsTrue(PyList_GET_ITEM(c->odd, 0)))
        return SLOW;
    uint64_t stack[U64_STACK];
    uint64_t *ks = n <= U64_STACK ? stack : PyMem_Malloc(sizeof(uint64_t) * (size_t)n);
    if (ks == NULL) {
        PyErr_NoMemory();
        return ERR;
    }
    int rc = ERR;
    if (!hashes_u64(ev, ks)) {
        rc = SLOW;
        goto out;
    }
    prefetch_learned(c->lmap, ks, n);
    for (Py_ssize_t i = 0; i < n; i++) {
        int is_int;
        uint64_t u;
        PyObject *obj;
        int f = lt_lookup(c->lmap, ks[i], &is_int, &u, &obj);
        if (f < 0)
            goto out;
        if (f == 0 || !is_int) {
            rc = SLOW; /* not joinable yet (held by the Python path), or a partial block */
            goto out;
        }
        ks[i] = u;
    }
    c->offload_blocks += n;
    uint32_t bit = bit_of(c, tier);
    prefetch_masks(c->table, ks, n);
    for (Py_ssize_t i = 0; i < n; i++)
        if (mt_set_bit(c->table, ks[i], bit) < 0)
            goto out;
    rc = 0;
out:
    if (ks != stack)
        PyMem_Free(ks);
    return rc;
}

static int
apply_removed(Ctx *c, Ev *ev, int tier)
{
    /* one key per hash: a token tier with engine blocks no larger than a canonical block, or an
     * offload tier whose chunks are one key; anything else in Python */
    int token_tier = (c->token_tiers >> tier) & 1 || (tier == 0 && c->token_tiers == 0);
    if (c->block_size / c->C > 1)
        return SLOW;
    if (!token_tier && !PyObject_IsTrue(PyTuple_GET_ITEM(c->remove_one, tier)))
        return SLOW;
    Py_ssize_t n = ev->n_hashes;
    uint64_t stack[U64_STACK];
    int8_t known_stack[U64_STACK];
    uint64_t *ks = n <= U64_STACK ? stack : PyMem_Malloc(sizeof(uint64_t) * (size_t)n);
    int8_t *known = n <= U64_STACK ? known_stack : PyMem_Malloc((size_t)n);
    int rc = ERR;
    if (ks == NULL || known == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    if (!hashes_u64(ev, ks)) {
        rc = SLOW;
        goto out;
    }
    prefetch_learned(c->lmap, ks, n);
    /* check first: every learned value must be a plain key */
    for (Py_ssize_t i = 0; i < n; i++) {
        int is_int = 0;
        uint64_t u = 0;
        PyObject *obj;
        int f = lt_lookup(c->lmap, ks[i], &is_int, &u, &obj);
        if (f < 0)
            goto out;
        known[i] = (int8_t)f;
        if (f == 1 && !is_int) {
            rc = SLOW;
            goto out;
        }
        ks[i] = u;
    }
    uint32_t bit = bit_of(c, tier);
    int gone = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!known[i]) {
            c->remove_unknown++;
            continue;
        }
        c->blocks_removed++;
        gone += mt_clear_bit(c->table, ks[i], bit);
    }
    if (gone)
        c->table->version++;
    rc = 0;
out:
    if (ks != NULL && ks != stack)
        PyMem_Free(ks);
    if (known != NULL && known != known_stack)
        PyMem_Free(known);
    return rc;
}

/* The endpoint's context, a tuple made by KVRouter._fast_ctx:
 * (stamp, endpoint, lmap, table, seed, C, odd, block_size, token_tiers, tier_names, bits,
 *  store_chunk, remove_one, max_entries, stats, learned) */
#define CTX_LEN 16

static int
ctx_from(PyObject *t, Ctx *c)
{
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != CTX_LEN) {
        PyErr_SetString(PyExc_TypeError, "fastpath context: a 16-tuple expected");
        return -1;
    }
    memset(c, 0, sizeof(*c));
    c->ep = PyTuple_GET_ITEM(t, 1);
    PyObject *lmap = PyTuple_GET_ITEM(t, 2);
    PyObject *table = PyTuple_GET_ITEM(t, 3);
    c->seed = PyTuple_GET_ITEM(t, 4);
    c->C = PyLong_AsLongLong(PyTuple_GET_ITEM(t, 5));
    c->odd = PyTuple_GET_ITEM(t, 6);
    c->block_size = c->block_size0 = PyLong_AsLongLong(PyTuple_GET_ITEM(t, 7));
    c->token_tiers = c->token_tiers0 = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(t, 8));
    c->tier_names = PyTuple_GET_ITEM(t, 9);
    c->bits = PyTuple_GET_ITEM(t, 10);
    c->store_chunk = PyTuple_GET_ITEM(t, 11);
    c->remove_one = PyTuple_GET_ITEM(t, 12);
    c->max_entries = PyLong_AsLongLong(PyTuple_GET_ITEM(t, 13));
    c->stats = PyTuple_GET_ITEM(t, 14);
    c->learned = PyTuple_GET_ITEM(t, 15);
    if (PyErr_Occurred())
        return -1;
    if (stats_type == NULL || Py_TYPE(c->stats) != stats_type || Py_TYPE(c->learned) != learned_type) {
        PyErr_SetString(PyExc_TypeError, "fastpath context: counters not bound (bind_counters) or of another type");
        return -1;
    }
    if (!PyObject_TypeCheck(lmap, &LearnedTableType) || !PyObject_TypeCheck(table, &MaskTableType) ||
        !PyLong_CheckExact(c->seed) || !PyList_Check(c->odd) ||
        PyList_GET_SIZE(c->odd) < 1 || !PyTuple_Check(c->tier_names) || !PyTuple_Check(c->bits) ||
        !PyTuple_Check(c->store_chunk) || !PyTuple_Check(c->remove_one) || c->C <= 0) {
        PyErr_SetString(PyExc_TypeError, "fastpath context: wrong types");
        return -1;
    }
    c->table = (MaskTable *)table;
    c->lmap = (LearnedTable *)lmap;
    c->seed_u = AS_U64(c->seed);
    if (c->seed_u == (uint64_t)-1 && PyErr_Occurred())
        return -1;
    c->n_tiers = PyTuple_GET_SIZE(c->tier_names);
    if (PyTuple_GET_SIZE(c->bits) != c->n_tiers || PyTuple_GET_SIZE(c->store_chunk) != c->n_tiers ||
        PyTuple_GET_SIZE(c->remove_one) != c->n_tiers || c->n_tiers > 63) {
        PyErr_SetString(PyExc_TypeError, "fastpath context: per-tier tuples of unequal length");
        return -1;
    }
    for (Py_ssize_t i = 0; i < c->n_tiers; i++) {
        long b = PyLong_AsLong(PyTuple_GET_ITEM(c->bits, i));
        if (b < 0 || (uint64_t)b >= (uint64_t)c->table->W * 64) {
            PyErr_Clear();
            PyErr_SetString(PyExc_ValueError, "fastpath context: a tier bit outside the table");
            return -1;
        }
    }
    return 0;
}


/* Account what was done into the router's counters; returns None when the caller has
 * nothing left to do (the whole batch applied, nothing else changed), else
 * (status, next event, changed, block size, token-tier mask, learned over budget, endpoint). */
static PyObject *
finish(int status, int64_t next, Ctx *c, Py_ssize_t learned, int first_call)
{
    if ((first_call && counter_add(c->stats, K_BATCHES, 1) < 0) || counter_add(c->stats, K_EVENTS, c->events) < 0 ||
        counter_add(c->stats, K_STORED, c->blocks_stored) < 0 ||
        counter_add(c->stats, K_OFFLOAD, c->offload_blocks) < 0 ||
        counter_add(c->stats, K_REMOVED, c->blocks_removed) < 0 ||
        counter_add(c->stats, K_UNKNOWN, c->remove_unknown) < 0 ||
        counter_add(c->stats, K_IGNORED, c->ignored) < 0 || counter_add(c->learned, K_LEARNED, learned) < 0)
        return NULL;
    int changed = c->block_size != c->block_size0 || c->token_tiers != c->token_tiers0;
    PyObject *size = *counter_slot(c->learned, K_LEARNED), *max = *counter_slot(c->learned, K_LEARNED_MAX);
    int over = size != NULL && max != NULL ? PyObject_RichCompareBool(size, max, Py_GT) : 0;
    if (over < 0)
        return NULL;
    if (status == 0 && !changed && !over)
        Py_RETURN_NONE;
    return Py_BuildValue("(iLiLKiO)", status, (long long)next, changed, (long long)c->block_size,
                         (unsigned long long)c->token_tiers, over, c->ep);
}

#define MAX_EVENTS_ON_STACK 64
#define PREFETCH_MAX 1024

/* The index is memory-bound: each engine hash costs a few cache misses (learned-table slot and
 * entry, mask-table slot and entry), and done one after the other they add up. Before applying
 * a batch, walk its hashes in passes that only read and prefetch — learned slots, learned
 * entries, then (looking the keys up) mask slots, then mask entries — so each kind of miss is in
 * flight for every hash of the batch at once. Read-only: the apply loop after it decides. */
static void
prefetch_batch(Ctx *c, const Ev *evs, int64_t from, int64_t nev)
{
    uint64_t hs[PREFETCH_MAX];
    int n = 0;
    for (int64_t j = from; j < nev && n < PREFETCH_MAX; j++) {
        const uint8_t *hp = evs[j].hashes;
        for (uint32_t h = 0; h < evs[j].n_hashes && n < PREFETCH_MAX; h++) {
            Rd r = {hp, hp + 9};
            uint64_t u = 0;
            int64_t sv = 0;
            if (rd_int(&r, &u, &sv) != 1)
                break;
            hp = r.p;
            hs[n++] = u;
        }
    }
    for (int k = 0; k < n; k++)
        lt_prefetch_slot(c->lmap, hs[k]);
    for (int k = 0; k < n; k++)
        lt_prefetch_entry(c->lmap, hs[k]);
    for (int k = 0; k < n; k++) {
        uint32_t e = lt_find(c->lmap, hs[k], NULL);
        hs[k] = e != MT_NONE && c->lmap->ent[e].tag == LT_INT ? c->lmap->ent[e].val : MT_NOPAR;
        if (hs[k] != MT_NOPAR)
            mt_prefetch_slot(c->table, hs[k]);
    }
    for (int k = 0; k < n; k++)
        if (hs[k] != MT_NOPAR)
            mt_prefetch_entry(c->table, hs[k]);
}

static PyObject *str_fast_ctx, *str_py_touch, *str_fast_rest, *str_expire_pending, *str_apply_payload_py;

/* The work of apply(): ctx_fn is called on a context-cache miss (or, when NULL, the method
 * _fast_ctx of `owner`). */
static PyObject *
apply_impl(PyObject *payload, Py_ssize_t start, PyObject *contexts, PyObject *stamp, PyObject *ctx_fn,
           PyObject *owner, PyObject *pod, PyObject *model)
{
    Py_buffer buf;
    if (PyObject_GetBuffer(payload, &buf, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *result = NULL;
    PyObject *rank = NULL, *t = NULL;
    Ev stack_evs[MAX_EVENTS_ON_STACK];
    Ev *evs = stack_evs;
    if ((start == -1 && PyErr_Occurred()) || !PyDict_Check(contexts)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "apply: contexts must be a dict");
        goto done;
    }
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
    /* (the endpoint's key: the rank, None counting as 0) */
    rank = PyLong_FromLongLong(rank_v);
    if (rank == NULL)
        goto done;

    /* --- the endpoint's context: cached per rank while its stamp is current */
    t = PyDict_GetItemWithError(contexts, rank);
    if (t != NULL && PyTuple_Check(t) && PyTuple_GET_SIZE(t) == CTX_LEN &&
        PyObject_RichCompareBool(PyTuple_GET_ITEM(t, 0), stamp, Py_EQ) == 1) {
        Py_INCREF(t);
    } else {
        if (PyErr_Occurred())
            goto done;
        t = ctx_fn != NULL ? PyObject_CallFunctionObjArgs(ctx_fn, pod, model, rank, NULL)
                           : PyObject_CallMethodObjArgs(owner, str_fast_ctx, pod, model, rank, NULL);
        if (t == NULL)
            goto done;
    }
    Ctx c;
    if (ctx_from(t, &c) < 0)
        goto done;
    Py_ssize_t learned0 = lt_len(c.lmap);
    int status = 0;
    int64_t i = start < 0 ? 0 : start;
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
        if (ev->type == EV_STORED && !ev->ignored_group && bookkeeping_due(&c)) {
            status = BOOKKEEP;
            i++;
            break;
        }
    }
    result = finish(status, i, &c, lt_len(c.lmap) - learned0, start <= 0);
    goto done;

to_python:
    /* the whole batch needs the Python decoder; nothing was changed */
    result = Py_BuildValue("(iLiLKiO)", 3, 0LL, 0, 0LL, 0ULL, 0, Py_None);
done:
    Py_XDECREF(t);
    Py_XDECREF(rank);
    if (evs != stack_evs)
        PyMem_Free(evs);
    PyBuffer_Release(&buf);
    return result;
}

/* apply(payload, start, contexts, stamp, ctx_fn, pod, model) */
static PyObject *
py_apply(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "apply(payload, start, contexts, stamp, ctx_fn, pod, model)");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[1]);
    if (start == -1 && PyErr_Occurred())
        return NULL;
    return apply_impl(args[0], start, args[2], args[3], args[4], NULL, args[5], args[6]);
}

/* apply_payload(router, contexts_by_pod, pending_by_hash, pending, pod, payload, *, model=None,
 * strict=False): KVRouter.apply_payload in C (bound per router with functools.partial), so a
 * batch that applies entirely in C costs no Python frame at all. */
static PyObject *
py_apply_payload(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *model = Py_None, *strict = Py_False;
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    if (nargs < 6 || nargs > 8) {
        PyErr_SetString(PyExc_TypeError, "apply_payload(pod, payload, *, model=None, strict=False)");
        return NULL;
    }
    if (nargs > 6)
        model = args[6];
    if (nargs > 7)
        strict = args[7];
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
    PyObject *router = args[0], *by_pod = args[1], *pending_by_hash = args[2], *pending = args[3];
    PyObject *pod = args[4], *payload = args[5];
    if (!PyDict_Check(by_pod)) {
        PyErr_SetString(PyExc_TypeError, "apply_payload: contexts must be a dict");
        return NULL;
    }
    int held = PyObject_IsTrue(pending_by_hash);
    if (held < 0)
        return NULL;
    if (held) /* offloads waiting for their GPU events: the Python path resolves them */
        return PyObject_CallMethodObjArgs(router, str_apply_payload_py, pod, payload, model, strict, NULL);
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
    PyObject *stamp = PyObject_GetAttr(router, str_py_touch);
    if (stamp == NULL)
        return NULL;
    PyObject *out = apply_impl(payload, 0, contexts, stamp, NULL, router, pod, model);
    Py_DECREF(stamp);
    if (out == NULL)
        return NULL;
    if (out != Py_None) {
        PyObject *r = PyObject_CallMethodObjArgs(router, str_fast_rest, pod, payload, model, strict, contexts, out,
                                                 NULL);
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
        return PyObject_CallMethodObjArgs(router, str_expire_pending, NULL);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"apply_payload", (PyCFunction)(void (*)(void))py_apply_payload, METH_FASTCALL | METH_KEYWORDS,
     "KVRouter.apply_payload in C: bind with functools.partial(apply_payload, router, contexts, "
     "pending_by_hash, pending)."},
    {"bind_counters", py_bind_counters, METH_VARARGS,
     "bind_counters(RouterStats, LearnedMap): where apply() finds the counters it updates."},
    {"chain_keys", py_chain_keys, METH_VARARGS, "Chained router keys of every full block (see consumers.keys)."},
    {"apply", (PyCFunction)(void (*)(void))py_apply, METH_FASTCALL,
     "Apply a KVEventBatch payload's common events (see consumers.fastingest)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "consumers._fastpath", "The router's ingest and key hashing in C.", -1, methods,
};

PyMODINIT_FUNC
PyInit__fastpath(void)
{
    if (PyType_Ready(&MaskTableType) < 0)
        return NULL;
    if ((str_fast_ctx = PyUnicode_InternFromString("_fast_ctx")) == NULL ||
        (str_py_touch = PyUnicode_InternFromString("_py_touch")) == NULL ||
        (str_fast_rest = PyUnicode_InternFromString("_fast_rest")) == NULL ||
        (str_expire_pending = PyUnicode_InternFromString("_expire_pending")) == NULL ||
        (str_apply_payload_py = PyUnicode_InternFromString("_apply_payload_py")) == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyType_Ready(&LearnedTableType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&MaskTableType);
    if (PyModule_AddObject(m, "MaskTable", (PyObject *)&MaskTableType) < 0) {
        Py_DECREF(&MaskTableType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&LearnedTableType);
    if (PyModule_AddObject(m, "LearnedTable", (PyObject *)&LearnedTableType) < 0) {
        Py_DECREF(&LearnedTableType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
