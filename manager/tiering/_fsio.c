/* manager.tiering._fsio: the fs tier's load and store paths in C, without the GIL (optional
 * extension).
 *
 * Measured before it existed (issue 14): a bare Python loop of two-iovec O_DIRECT preadv read
 * the tier's own files at 0.69-0.82 GB/s while the tier, driving the same reads from 64 Python
 * threads with a per-block Python path, read them at 0.41-0.48: the reads waited for the GIL,
 * not for the disk. Here one call hands a whole job's blocks to a pool of C threads (the queue
 * depth the disk needs) and waits with the GIL released; per block a worker does
 *
 *   open (O_DIRECT or buffered) -> one preadv of header page + payload straight into the slot
 *   (an aligned per-thread bounce buffer only when O_DIRECT meets an unaligned slot) -> header
 *   check (magic, version, checksum kind, header checksum, key, length, size) -> checksum of
 *   the payload (CRC32C: SSE4.2 or table; CRC32: zlib) -> close
 *
 * or, staged (load(..., staged=True) with O_DIRECT: the tier's load_staging), one request of
 * header + payload into the worker's 2 MiB staging area in a transparent huge page, the same
 * checks there, then one memcpy into the slot. Why: a disk that costs per segment of a request
 * (our test VM's virtio disk) reads a 256 KiB block faster as one segment than as the 65 a slot
 * in 4 KiB pages makes, for the cost of the copy (the runs: benchmarks/NOTES.md, "Staged loads").
 *
 * and the call returns one status per block: 0 ok, 1..8 the reasons of
 * manager.tiering.fs_io.BlockFileError (REASONS[status]), or -errno for an OSError. Stores
 * the same way: header + payload in one pwritev to a temp file, fdatasync on request, rename
 * (_fsio_block.h). The file format is fs_io.py's (the two must agree; tests read each side's
 * files with the other).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>

#include "_fsio_block.h"

static const char *const REASONS[] = {"ok", "missing", "short", "magic", "header", "key", "length", "checksum",
                                      "unverifiable"};

enum { OP_LOAD, OP_STORE };

typedef struct kv_batch {
    kv_item *items;
    size_t n, next, left, nbytes;
    int op, direct, kind, sync, staged;
    pthread_cond_t done; /* signalled when left reaches 0 (one waiter: the caller) */
    struct kv_batch *qnext;
} kv_batch;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t work;
    kv_batch *head, *tail;
    pthread_t *tids;
    int nthreads, started, closing;
    pid_t pid;
} IOPool;

static void *worker(void *arg) {
    IOPool *p = (IOPool *)arg;
    kv_bufs bufs = {NULL, NULL, NULL, 0, 0};
    if (posix_memalign((void **)&bufs.head, ALIGN, HEADER_SIZE)) bufs.head = NULL;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->head && !p->closing) pthread_cond_wait(&p->work, &p->mu);
        if (!p->head) break; /* closing, and nothing queued */
        kv_batch *b = p->head;
        kv_item *it = &b->items[b->next++];
        if (b->next == b->n) {
            p->head = b->qnext;
            if (!p->head) p->tail = NULL;
        }
        pthread_mutex_unlock(&p->mu);
        if (!bufs.head) it->status = -ENOMEM;
        else if (b->op == OP_LOAD) it->status = load_one(it, b->nbytes, b->direct, b->staged, &bufs);
        else it->status = store_one(it, b->nbytes, b->direct, b->kind, b->sync, &bufs);
        pthread_mutex_lock(&p->mu);
        if (--b->left == 0) pthread_cond_signal(&b->done);
    }
    pthread_mutex_unlock(&p->mu);
    free_bufs(&bufs);
    return NULL;
}

static void pool_reset_sync(IOPool *p) {
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->work, NULL);
    p->head = p->tail = NULL;
    p->started = 0;
    p->pid = getpid();
}

/* (GIL held) Start the workers on first use, and again in a child after fork (threads do not
 * survive a fork; the parent's queue is not the child's). */
static int pool_start(IOPool *p) {
    if (p->closing) {
        PyErr_SetString(PyExc_ValueError, "IOPool is closed");
        return -1;
    }
    if (p->started && p->pid != getpid()) pool_reset_sync(p);
    if (p->started) return 0;
    if (!p->tids) p->tids = (pthread_t *)calloc((size_t)p->nthreads, sizeof(pthread_t));
    if (!p->tids) {
        PyErr_NoMemory();
        return -1;
    }
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    int made = 0;
    for (; made < p->nthreads; made++)
        if (pthread_create(&p->tids[made], &attr, worker, p) != 0) break;
    pthread_attr_destroy(&attr);
    if (made == 0) {
        PyErr_SetString(PyExc_OSError, "IOPool: could not start any thread");
        return -1;
    }
    p->nthreads = made;
    p->started = 1;
    return 0;
}

static int pool_init(IOPool *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"threads", NULL};
    int threads = 32;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|i", kwlist, &threads)) return -1;
    if (threads <= 0 || threads > 4096) {
        PyErr_Format(PyExc_ValueError, "IOPool: threads must be in 1..4096, got %d", threads);
        return -1;
    }
    self->nthreads = threads;
    return 0;
}

static PyObject *pool_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    IOPool *self = (IOPool *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    pool_reset_sync(self);
    self->tids = NULL;
    self->closing = 0;
    self->nthreads = 32;
    return (PyObject *)self;
}

static void pool_stop(IOPool *p) {
    if (!p->started || p->pid != getpid()) {
        p->closing = 1;
        p->started = 0;
        return;
    }
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&p->mu);
    p->closing = 1;
    pthread_cond_broadcast(&p->work);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->nthreads; i++) pthread_join(p->tids[i], NULL);
    Py_END_ALLOW_THREADS
    p->started = 0;
}

static PyObject *pool_close(IOPool *self, PyObject *unused) {
    if (!self->closing || self->started) pool_stop(self);
    Py_RETURN_NONE;
}

static void pool_dealloc(IOPool *self) {
    pool_stop(self);
    free(self->tids);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

typedef struct {
    PyObject *path, *tmp;
    Py_buffer slot, key;
} kv_hold;

static void release_holds(kv_hold *h, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_XDECREF(h[i].path);
        Py_XDECREF(h[i].tmp);
        if (h[i].slot.obj) PyBuffer_Release(&h[i].slot);
        if (h[i].key.obj) PyBuffer_Release(&h[i].key);
    }
    free(h);
}

/* (GIL held) Run batch `b` on the pool's threads and wait for it, the GIL released. */
static int pool_run(IOPool *p, kv_batch *b) {
    if (!b->n) return 0;
    if (pool_start(p) < 0) return -1;
    int closed = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_cond_init(&b->done, NULL);
    pthread_mutex_lock(&p->mu);
    if (p->closing) { /* a close() on another thread got here first: its workers may be gone */
        closed = 1;
    } else {
        if (p->tail) p->tail->qnext = b;
        else p->head = b;
        p->tail = b;
        pthread_cond_broadcast(&p->work);
        while (b->left) pthread_cond_wait(&b->done, &p->mu);
    }
    pthread_mutex_unlock(&p->mu);
    pthread_cond_destroy(&b->done);
    Py_END_ALLOW_THREADS
    if (closed) {
        PyErr_SetString(PyExc_ValueError, "IOPool is closed");
        return -1;
    }
    return 0;
}

/* load: items (path, slot, key); store: items (tmp, path, slot, key). Fills b and h, runs the
 * batch, returns the statuses as a list. */
static PyObject *pool_call(IOPool *self, PyObject *items, kv_batch *b) {
    int store = b->op == OP_STORE, width = store ? 4 : 3;
    PyObject *seq = PySequence_Fast(items, "items must be a sequence of tuples");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), i = 0;
    kv_hold *h = (kv_hold *)calloc((size_t)(n ? n : 1), sizeof(kv_hold));
    kv_item *it = (kv_item *)calloc((size_t)(n ? n : 1), sizeof(kv_item));
    PyObject *out = NULL;
    if (!h || !it) {
        PyErr_NoMemory();
        goto done;
    }
    for (; i < n; i++) {
        PyObject *t = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != width) {
            PyErr_Format(PyExc_TypeError, "items[%zd] must be a %s tuple", i,
                         store ? "(tmp, path, slot, key)" : "(path, slot, key)");
            goto done;
        }
        if (store && !PyUnicode_FSConverter(PyTuple_GET_ITEM(t, 0), &h[i].tmp)) goto done;
        if (!PyUnicode_FSConverter(PyTuple_GET_ITEM(t, store), &h[i].path)) goto done;
        int flags = store ? PyBUF_C_CONTIGUOUS : PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(t, store + 1), &h[i].slot, flags) < 0) goto done;
        if ((size_t)h[i].slot.len != b->nbytes) {
            PyErr_Format(PyExc_ValueError, "items[%zd]: slot of %zd bytes, blocks are %zu", i, h[i].slot.len, b->nbytes);
            goto done;
        }
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(t, store + 2), &h[i].key, PyBUF_SIMPLE) < 0) goto done;
        if (store && h[i].key.len > MAX_KEY) {
            PyErr_Format(PyExc_ValueError, "items[%zd]: key of %zd bytes does not fit the header (%d max)", i,
                         h[i].key.len, MAX_KEY);
            goto done;
        }
        it[i].tmp = store ? PyBytes_AS_STRING(h[i].tmp) : NULL;
        it[i].path = PyBytes_AS_STRING(h[i].path);
        it[i].slot = (unsigned char *)h[i].slot.buf; /* (a store only reads it) */
        it[i].key = (const unsigned char *)h[i].key.buf;
        it[i].klen = (size_t)h[i].key.len;
    }
    b->items = it;
    b->n = b->left = (size_t)n;
    if (pool_run(self, b) < 0) goto done;
    out = PyList_New(n);
    if (!out) goto done;
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *v = PyLong_FromLong(it[j].status);
        if (!v) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, j, v);
    }
done:
    if (h) release_holds(h, i < n ? i + 1 : n);
    free(it);
    Py_DECREF(seq);
    return out;
}

PyDoc_STRVAR(pool_load_doc,
             "load(items, nbytes, direct, staged=False) -> list[int]\n\n"
             "Read and check each item's block file into its slot; items are (path, slot, key) with\n"
             "slot a writable contiguous buffer of nbytes bytes. staged (with direct): each file is\n"
             "read as one request into the worker's staging area (2 MiB, huge pages where the kernel\n"
             "gives them) and copied into the slot once checked. One status per item, in order: 0 ok,\n"
             "REASONS[s] for a damaged or missing file, -errno for an OSError. The GIL is released\n"
             "while the pool's threads work; a slot whose status is not 0 holds garbage.");

static PyObject *pool_load(IOPool *self, PyObject *args) {
    PyObject *items;
    Py_ssize_t nbytes;
    int direct, staged = 0;
    if (!PyArg_ParseTuple(args, "Onp|p", &items, &nbytes, &direct, &staged)) return NULL;
    if (nbytes < 0) return PyErr_Format(PyExc_ValueError, "nbytes must be >= 0, got %zd", nbytes);
    kv_batch b = {NULL, 0, 0, 0, (size_t)nbytes, OP_LOAD, direct, 0, 0, staged};
    return pool_call(self, items, &b);
}

PyDoc_STRVAR(pool_store_doc,
             "store(items, nbytes, direct, kind, sync) -> list[int]\n\n"
             "Write each item's slot as a block file; items are (tmp, path, slot, key): header page +\n"
             "payload in one pwritev to tmp (created, O_EXCL), fdatasync'ed if sync, renamed to path.\n"
             "kind: the checksum (1 CRC32C, 2 CRC32). One status per item: 0 ok or -errno (then no\n"
             "temp file is left). The GIL is released while the pool's threads work.");

static PyObject *pool_store(IOPool *self, PyObject *args) {
    PyObject *items;
    Py_ssize_t nbytes;
    int direct, kind, sync;
    if (!PyArg_ParseTuple(args, "Onpip", &items, &nbytes, &direct, &kind, &sync)) return NULL;
    if (nbytes < 0) return PyErr_Format(PyExc_ValueError, "nbytes must be >= 0, got %zd", nbytes);
    if (kind != CRC_CRC32C && kind != CRC_CRC32) return PyErr_Format(PyExc_ValueError, "unknown checksum kind %d", kind);
    kv_batch b = {NULL, 0, 0, 0, (size_t)nbytes, OP_STORE, direct, kind, sync, 0};
    return pool_call(self, items, &b);
}

static PyObject *pool_threads(IOPool *self, void *closure) { return PyLong_FromLong(self->nthreads); }

static PyMethodDef pool_methods[] = {
    {"load", (PyCFunction)pool_load, METH_VARARGS, pool_load_doc},
    {"store", (PyCFunction)pool_store, METH_VARARGS, pool_store_doc},
    {"close", (PyCFunction)pool_close, METH_NOARGS, "Stop the threads (after the queued work). Idempotent."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef pool_getset[] = {
    {"threads", (getter)pool_threads, NULL, "worker threads (the queue depth offered to the disk)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject IOPoolType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "manager.tiering._fsio.IOPool",
    .tp_basicsize = sizeof(IOPool),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "IOPool(threads=32): C threads that read and check block files (see load).",
    .tp_new = pool_new,
    .tp_init = (initproc)pool_init,
    .tp_dealloc = (destructor)pool_dealloc,
    .tp_methods = pool_methods,
    .tp_getset = pool_getset,
};

PyDoc_STRVAR(crc32c_doc, "crc32c(data, value=0) -> int: CRC32C of a buffer, continuing from value (GIL "
                         "released for large buffers).");

static PyObject *py_crc32c(PyObject *mod, PyObject *args) {
    Py_buffer b;
    unsigned int value = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &b, &value)) return NULL;
    uint32_t c;
    if (b.len >= 65536) {
        Py_BEGIN_ALLOW_THREADS
        c = kv_crc32c(value, b.buf, (size_t)b.len);
        Py_END_ALLOW_THREADS
    } else {
        c = kv_crc32c(value, b.buf, (size_t)b.len);
    }
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLong(c);
}

/* (tests) the table fallback, whatever the CPU has */
static PyObject *py_crc32c_table(PyObject *mod, PyObject *args) {
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "y*", &b)) return NULL;
    uint32_t c = ~kv_crc_sw(~0u, (const unsigned char *)b.buf, (size_t)b.len);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLong(c);
}

static PyMethodDef module_methods[] = {
    {"crc32c", py_crc32c, METH_VARARGS, crc32c_doc},
    {"crc32c_table", py_crc32c_table, METH_VARARGS, "crc32c_table(data) -> int: the table fallback (for tests)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef fsio_module = {PyModuleDef_HEAD_INIT, "manager.tiering._fsio",
                                         "The fs tier's load path and CRC32C in C (see _fsio.c).", -1, module_methods};

PyMODINIT_FUNC PyInit__fsio(void) {
    kv_crc_init();
    if (PyType_Ready(&IOPoolType) < 0) return NULL;
    PyObject *m = PyModule_Create(&fsio_module);
    if (!m) return NULL;
    Py_INCREF(&IOPoolType);
    if (PyModule_AddObject(m, "IOPool", (PyObject *)&IOPoolType) < 0) goto fail;
    PyObject *reasons = PyTuple_New(sizeof(REASONS) / sizeof(REASONS[0]));
    if (!reasons) goto fail;
    for (size_t i = 0; i < sizeof(REASONS) / sizeof(REASONS[0]); i++)
        PyTuple_SET_ITEM(reasons, i, PyUnicode_FromString(REASONS[i]));
    if (PyModule_AddObject(m, "REASONS", reasons) < 0) goto fail;
    if (PyModule_AddIntConstant(m, "CRC32C_HARDWARE", kv_crc_hw == 1) < 0) goto fail;
    if (PyModule_AddIntConstant(m, "HEADER_SIZE", HEADER_SIZE) < 0) goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
