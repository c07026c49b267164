/* _oa.h: open addressing with incremental rehash, shared by MaskTable (_masktable.h) and
 * LearnedTable (_learned.h). Included by _fastpath.c's headers (one extension module). */
#ifndef KVEVENTS_OA_H
#define KVEVENTS_OA_H

#define MT_NONE ((uint32_t)0xFFFFFFFFu) /* no entry (both tables) */

/* --- open addressing, shared by MaskTable and LearnedTable (_learned.h) ------------------
 * A table of u32 slots, each 0 (empty) or an entry number + 1, probed linearly from a key's
 * home slot; a deletion shifts later entries of the probe run back (no tombstones). */

static inline uint32_t
oa_home(uint64_t k, uint32_t slot_mask)
{
    return (uint32_t)((k * 0x9E3779B97F4A7C15ULL) >> 32) & slot_mask;
}

/* a new, empty slot array of `size` (a power of two), or NULL with MemoryError */
static uint32_t *
oa_new_slots(uint32_t size)
{
    uint32_t *slot = PyMem_RawCalloc(size, sizeof(uint32_t));
    if (slot == NULL)
        PyErr_NoMemory();
    return slot;
}

/* put entry e (key k) in the first free slot of its probe run (rebuilding an index) */
static inline void
oa_place(uint32_t *slot, uint32_t slot_mask, uint64_t k, uint32_t e)
{
    uint32_t i = oa_home(k, slot_mask);
    while (slot[i])
        i = (i + 1) & slot_mask;
    slot[i] = e + 1;
}

/* the key of entry e of `table` (each table says where its keys are) */
typedef uint64_t (*oa_key_fn)(const void *table, uint32_t e);

/* empty slot `pos`, moving back the entries after it whose home allows */
static void
oa_delete(uint32_t *slot, uint32_t slot_mask, uint32_t pos, const void *table, oa_key_fn key_of)
{
    uint32_t i = pos;
    for (;;) {
        slot[i] = 0;
        uint32_t j = i;
        for (;;) {
            j = (j + 1) & slot_mask;
            uint32_t s = slot[j];
            if (s == 0)
                return;
            uint32_t home = oa_home(key_of(table, s - 1), slot_mask);
            /* can the entry at j move to i? only if i lies cyclically in [home, j) */
            if (i <= j ? (home <= i || home > j) : (home <= i && home > j)) {
                slot[i] = s;
                i = j;
                break;
            }
        }
    }
}

/* An incremental rehash (MaskTable and LearnedTable): the table being drained into a new one
 * twice its size. The new one takes every insert; each insert or update moves the old one's
 * next `step` positions over; a lookup that misses the new one looks in the old one. A moved
 * or deleted old position becomes OA_TOMB (lookups probe past it, so probe runs stay whole).
 * With step >= 2 the old table is empty before the new one reaches its load limit (1/2). */
#define OA_TOMB ((uint32_t)0xFFFFFFFFu) /* old-table slot: moved or deleted (never entry + 1) */
#define OA_OLD ((uint32_t)0x80000000u)  /* a position in the old table (tables hold <= 2**31 slots) */
#define OA_STEP 16                      /* old positions moved per insert or update, by default */

typedef struct {
    uint32_t *slot; /* NULL: no rehash under way */
    uint32_t mask;
    uint32_t next;  /* the next position to move */
} OaOld;

/* the old table's half of a lookup: the entry of k (*pos = OA_OLD | position), or MT_NONE.
 * Inlined into each table's lookup, so key_of is a direct, inlined access. */
static inline __attribute__((always_inline)) uint32_t
oa_find_old(const OaOld *o, uint64_t k, const void *table, oa_key_fn key_of, uint32_t *pos)
{
    const uint32_t *old = o->slot, mask = o->mask;
    uint32_t i = oa_home(k, mask);
    for (;;) {
        uint32_t s = old[i];
        if (s == 0)
            return MT_NONE;
        if (s != OA_TOMB && key_of(table, s - 1) == k) {
            if (pos) *pos = OA_OLD | i;
            return s - 1;
        }
        i = (i + 1) & mask;
    }
}

/* move the old table's next n positions (every one for n = 0) into slot[]; the old table is
 * freed when it is empty. Entries moved. (Inlined per table, like oa_find_old.) */
static inline __attribute__((always_inline)) uint64_t
oa_migrate(OaOld *o, uint32_t *slot, uint32_t slot_mask, uint32_t n, const void *table, oa_key_fn key_of)
{
    uint32_t *old = o->slot;
    if (old == NULL)
        return 0;
    uint64_t moved = 0;
    uint32_t i = o->next, size = o->mask + 1;
    uint32_t stop = n && size - i > n ? i + n : size;
    for (; i < stop; i++) {
        uint32_t s = old[i];
        if ((uint32_t)(s - 1) < OA_TOMB - 1) { /* neither empty nor a tombstone */
            oa_place(slot, slot_mask, key_of(table, s - 1), s - 1);
            old[i] = OA_TOMB;
            moved++;
        }
    }
    o->next = i;
    if (i == size) {
        PyMem_RawFree(old);
        o->slot = NULL;
        o->mask = o->next = 0;
    }
    return moved;
}

/* start draining (*slot, *slot_mask) into a new table twice its size (after finishing a
 * drain still under way: never with step >= 2). 0, or -1 with MemoryError */
static int
oa_start_rehash(OaOld *o, uint32_t **slot, uint32_t *slot_mask, const void *table, oa_key_fn key_of,
                uint64_t *moved)
{
    uint32_t *fresh = oa_new_slots((*slot_mask + 1) * 2);
    if (fresh == NULL)
        return -1;
    *moved += oa_migrate(o, *slot, *slot_mask, 0, table, key_of);
    o->slot = *slot;
    o->mask = *slot_mask;
    o->next = 0;
    *slot = fresh;
    *slot_mask = *slot_mask * 2 + 1;
    return 0;
}

#endif
