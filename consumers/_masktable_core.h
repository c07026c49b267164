/* _masktable_core.h: the MaskTable's layout (entries in segments, the slot table) and the few
 * accessors its growth (_masktable_grow.h) and its operations (_masktable.h) share. */
#ifndef KVEVENTS_MASKTABLE_CORE_H
#define KVEVENTS_MASKTABLE_CORE_H

#define MT_NOPAR ((uint64_t)0xFFFFFFFFFFFFFFFFULL) /* no parent link */

typedef struct {
    PyObject_HEAD
    uint32_t W;         /* 64-bit words per mask */
    uint32_t n;         /* live keys */
    uint32_t cap;       /* entries allocated (over every segment) */
    uint32_t used;      /* entries handed out so far (the rest of cap is untouched) */
    uint32_t free_head; /* recycled entries, chained through nxt */
    uint32_t head;      /* oldest */
    uint32_t tail;      /* newest */
    uint32_t seg_shift; /* entries live in segments of 1 << seg_shift entries (see mt_seg_shift) */
    uint32_t seg_mask;  /* (1 << seg_shift) - 1 */
    char **seg;         /* the segments, each aligned to 64 bytes; segment 0 grows to full size */
    void **seg_raw;     /* their allocations */
    uint32_t nseg;      /* segments in use */
    uint32_t seg_room;  /* pointers the two arrays above have room for */
    size_t stride;
    uint32_t *slot;     /* entry + 1; 0 = empty */
    uint32_t slot_mask; /* table size - 1 (a power of two) */
    OaOld old;          /* the previous, smaller table while an incremental rehash runs */
    uint32_t mig_step;  /* old positions moved per insert or update while a rehash runs */
    uint64_t version;   /* bumped by every change */
    long long entries;  /* set bits over every key: the index's (key, endpoint, tier) entries */
    unsigned long long moved_max;   /* most entries one operation moved (rehash + segment copy) */
    unsigned long long moved_total; /* entries moved by growth, over the table's life */
    unsigned long long rehashes;    /* incremental rehashes started */
} MaskTable;

/* One key's entry: everything a lookup, an LRU move and a bit update touch, together. */
typedef struct {
    uint64_t key;
    uint64_t par;       /* the key's parent key (what index.parents holds), or MT_NOPAR */
    uint32_t prv;       /* LRU links */
    uint32_t nxt;
    uint64_t bits[];    /* W words */
} MEnt;

/* Growth never stops the world: entries live in fixed-size segments (a new one is added when
 * the last is full; only segment 0 grows by copying, up to one segment), so an entry never
 * moves once its segment is full; the slot table doubles incrementally (OaOld above). */
#define MT_SEG_BYTES ((size_t)256 << 10) /* a full segment's size, about */

#define ENT(t, e) \
    ((MEnt *)((t)->seg[(uint32_t)(e) >> (t)->seg_shift] + \
              (size_t)((uint32_t)(e) & (t)->seg_mask) * (t)->stride))

static PyTypeObject MaskTableType;

static inline size_t
mt_stride(uint32_t W)
{
    size_t s = sizeof(MEnt) + (size_t)W * sizeof(uint64_t);
    return (s + 7) & ~(size_t)7;
}

static inline uint32_t
mt_home(const MaskTable *t, uint64_t k)
{
    return oa_home(k, t->slot_mask);
}

static uint64_t
mt_key_at(const void *t, uint32_t e)
{
    return ENT((const MaskTable *)t, e)->key;
}

/* the incremental rehash's two halves for this table (out of line: only while one runs) */
static __attribute__((noinline)) uint32_t
mt_find_old(const MaskTable *t, uint64_t k, uint32_t *pos)
{
    return oa_find_old(&t->old, k, t, mt_key_at, pos);
}

static __attribute__((noinline)) uint64_t
mt_migrate(MaskTable *t, uint32_t n)
{
    return oa_migrate(&t->old, t->slot, t->slot_mask, n, t, mt_key_at);
}

#endif
