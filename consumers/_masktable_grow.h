/* _masktable_grow.h: how MaskTable grows without stopping the world (entry segments, the
 * incremental rehash), and the counters that show it. Included by _masktable.h. */

/* entries per full segment: a power of two, about MT_SEG_BYTES of them, at least 64 */
static inline uint32_t
mt_seg_shift(size_t stride)
{
    uint32_t s = 6;
    while (s < 16 && ((size_t)2 << s) * stride <= MT_SEG_BYTES)
        s++;
    return s;
}

/* a zeroed block of n entries of `stride` bytes, aligned to 64: (raw, base) or -1 */
static int
mt_alloc_entries(size_t n, size_t stride, void **raw, char **base)
{
    void *r = PyMem_RawCalloc(1, n * stride + 64);
    if (r == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *raw = r;
    *base = (char *)(((uintptr_t)r + 63) & ~(uintptr_t)63);
    return 0;
}

static void
mt_store_free(MaskTable *t)
{
    for (uint32_t i = 0; i < t->nseg; i++)
        PyMem_RawFree(t->seg_raw[i]);
    PyMem_RawFree(t->seg_raw);
    PyMem_RawFree(t->seg);
    t->seg = NULL;
    t->seg_raw = NULL;
    t->nseg = t->seg_room = 0;
    t->cap = 0;
}

/* room for more entries: segment 0 doubles (copying its `used` entries) until it is a full
 * segment, then a new full segment is added. 0, or -1 with MemoryError */
static int
mt_store_add(MaskTable *t, uint64_t *moved)
{
    uint32_t full = (uint32_t)1 << t->seg_shift;
    if ((uint64_t)t->cap + (t->cap < full ? t->cap : full) >= MT_NONE) {
        PyErr_SetString(PyExc_MemoryError, "router index: too many keys");
        return -1;
    }
    if (t->seg_room == t->nseg) {
        uint32_t room = t->seg_room ? t->seg_room * 2 : 4;
        char **seg = PyMem_RawRealloc(t->seg, room * sizeof(char *));
        if (seg == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        t->seg = seg;
        void **raw = PyMem_RawRealloc(t->seg_raw, room * sizeof(void *));
        if (raw == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        t->seg_raw = raw;
        t->seg_room = room;
    }
    void *raw;
    char *base;
    if (t->cap < full) {
        uint32_t ncap = t->cap ? t->cap * 2 : 64;
        if (ncap > full)
            ncap = full;
        if (mt_alloc_entries(ncap, t->stride, &raw, &base) < 0)
            return -1;
        if (t->nseg) {
            memcpy(base, t->seg[0], (size_t)t->used * t->stride);
            *moved += t->used;
            PyMem_RawFree(t->seg_raw[0]);
        }
        t->seg[0] = base;
        t->seg_raw[0] = raw;
        t->nseg = 1;
        t->cap = ncap;
        return 0;
    }
    if (mt_alloc_entries(full, t->stride, &raw, &base) < 0)
        return -1;
    t->seg[t->nseg] = base;
    t->seg_raw[t->nseg] = raw;
    t->nseg++;
    t->cap += full;
    return 0;
}

/* bytes the entries take */
static size_t
mt_store_nbytes(const MaskTable *t)
{
    size_t full = (size_t)1 << t->seg_shift, b = (size_t)t->seg_room * 2 * sizeof(void *);
    for (uint32_t i = 0; i < t->nseg; i++)
        b += (i == 0 ? (t->cap < full ? t->cap : full) : full) * t->stride + 64;
    return b;
}

static inline void
mt_count_moved(MaskTable *t, uint64_t moved)
{
    if (moved) {
        t->moved_total += moved;
        if (moved > t->moved_max)
            t->moved_max = moved;
    }
}

/* room for one more key: 1 if the slot table changed (positions from mt_find are stale), 0 if
 * not, -1 with MemoryError. A table at its load limit starts an incremental rehash into one
 * twice its size, moving the first mig_step positions at once. */
static int
mt_reserve(MaskTable *t, uint64_t *moved)
{
    int changed = 0;
    if ((uint64_t)(t->n + 1) * 2 > (uint64_t)t->slot_mask + 1) {
        if (t->slot_mask >= 0x7FFFFFFFu) {
            PyErr_SetString(PyExc_MemoryError, "router index: too many keys");
            return -1;
        }
        if (oa_start_rehash(&t->old, &t->slot, &t->slot_mask, t, mt_key_at, moved) < 0)
            return -1;
        t->rehashes++;
        *moved += mt_migrate(t, t->mig_step);
        changed = 1;
    }
    if (t->free_head == MT_NONE && t->used == t->cap && mt_store_add(t, moved) < 0)
        return -1;
    return changed;
}

/* growth_stats() -> {moved_max, moved_total, rehashes, rehashing, mig_step, segment_entries} */
static PyObject *
mt_py_growth_stats(MaskTable *t, PyObject *unused)
{
    return Py_BuildValue("{sKsKsKsisIsI}", "moved_max", t->moved_max, "moved_total", t->moved_total, "rehashes",
                         t->rehashes, "rehashing", t->old.slot != NULL, "mig_step", t->mig_step,
                         "segment_entries", (unsigned int)1 << t->seg_shift);
}
