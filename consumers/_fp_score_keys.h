/* _fp_score_keys.h: a prompt's router keys from a buffer of token ids (array('I'), array('q'),
 * numpy...), bit for bit those of consumers.keys.chain_keys: each block's tuple hash as CPython
 * computes it, four blocks at a time, then the chain through them. Uses _fp_hash.h. */

/* ------------------------------------------------------------------ the keys */

/* the hash CPython gives item i of a buffer of ints of this kind */
static inline __attribute__((always_inline)) int64_t
item_hash(const char *base, Py_ssize_t i, char kind)
{
    switch (kind) {
    case 'I': { uint32_t x; memcpy(&x, base + i * 4, 4); return (int64_t)x; }
    case 'i': { int32_t x; memcpy(&x, base + i * 4, 4); return int_hash_s(x); }
    case 'Q': { uint64_t x; memcpy(&x, base + i * 8, 8); return int_hash_u(x); }
    default: { int64_t x; memcpy(&x, base + i * 8, 8); return int_hash_s(x); }
    }
}

/* content[b]: the tuple hash of block b's bs ints, for nb blocks. The blocks are independent:
 * four at a time, so that their chains of multiplies overlap (one block's is serial). kind is a
 * constant where this is inlined: no per-item switch. */
static inline __attribute__((always_inline)) void
contents_of(const char *base, char kind, Py_ssize_t bs, Py_ssize_t nb, int64_t *content)
{
    Py_ssize_t b = 0;
    for (; b + 4 <= nb; b += 4) {
        uint64_t a0 = XXP5, a1 = XXP5, a2 = XXP5, a3 = XXP5;
        Py_ssize_t i0 = b * bs;
        for (Py_ssize_t j = 0; j < bs; j++) {
            a0 = lane_mix(a0, item_hash(base, i0 + j, kind));
            a1 = lane_mix(a1, item_hash(base, i0 + bs + j, kind));
            a2 = lane_mix(a2, item_hash(base, i0 + 2 * bs + j, kind));
            a3 = lane_mix(a3, item_hash(base, i0 + 3 * bs + j, kind));
        }
        content[b] = tuple_end(a0, (uint64_t)bs);
        content[b + 1] = tuple_end(a1, (uint64_t)bs);
        content[b + 2] = tuple_end(a2, (uint64_t)bs);
        content[b + 3] = tuple_end(a3, (uint64_t)bs);
    }
    for (; b < nb; b++) {
        uint64_t a = XXP5;
        for (Py_ssize_t j = 0; j < bs; j++)
            a = lane_mix(a, item_hash(base, b * bs + j, kind));
        content[b] = tuple_end(a, (uint64_t)bs);
    }
}

#define KB_CHUNK 64

/* keys of every full block of the buffer's ints (itemsize 4 or 8, signed or not): the blocks'
 * content hashes a chunk at a time, then the chain through them (a key is < 2**60, so the
 * hash of a key, the next step's lane, is the key itself) */
static void
keys_of_buffer(const Py_buffer *v, char kind, Py_ssize_t bs, int64_t parent_lane, uint64_t *keys, Py_ssize_t nb)
{
    int64_t content[KB_CHUNK];
    int64_t lane = parent_lane;
    for (Py_ssize_t b0 = 0; b0 < nb; b0 += KB_CHUNK) {
        Py_ssize_t m = nb - b0 < KB_CHUNK ? nb - b0 : KB_CHUNK;
        const char *base = (const char *)v->buf + b0 * bs * v->itemsize;
        if (bs == 16 && kind == 'I') /* the default block size of the API's token buffers: unrolled */
            contents_of(base, 'I', 16, m, content);
        else if (kind == 'I')
            contents_of(base, 'I', bs, m, content);
        else if (kind == 'i')
            contents_of(base, 'i', bs, m, content);
        else if (kind == 'Q')
            contents_of(base, 'Q', bs, m, content);
        else
            contents_of(base, 'q', bs, m, content);
        for (Py_ssize_t b = 0; b < m; b++) {
            uint64_t k = chain_step_lane(lane, content[b]);
            keys[b0 + b] = k;
            lane = (int64_t)k;
        }
    }
}

/* the buffer's item kind for keys_of_buffer: 'I', 'i', 'Q', 'q', or 0 if not a 4/8-byte int */
static char
int_kind(const Py_buffer *v)
{
    const char *f = v->format ? v->format : "B";
    if (*f == '@' || *f == '=' || *f == '<')
        f++;
    if (f[0] == 0 || f[1] != 0)
        return 0;
    int is_signed = f[0] == 'i' || f[0] == 'l' || f[0] == 'q';
    int is_unsigned = f[0] == 'I' || f[0] == 'L' || f[0] == 'Q';
    if (!(is_signed || is_unsigned) || (v->itemsize != 4 && v->itemsize != 8))
        return 0;
    return v->itemsize == 4 ? (is_signed ? 'i' : 'I') : (is_signed ? 'q' : 'Q');
}
