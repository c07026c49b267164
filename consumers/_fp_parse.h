/* _fp_parse.h: the msgpack reader and the event parser (KVEventBatch map encoding).
 * Included by _fastpath.c (one extension module, one translation unit). */
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
static inline __attribute__((always_inline)) int
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
    const uint8_t *start;    /* where the event's map begins in the payload */
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
    const uint8_t *start = r->p;
    int64_t nf = rd_container(r, 1);
    if (nf < 0)
        return 0;
    memset(ev, 0, sizeof(*ev));
    ev->start = start;
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

