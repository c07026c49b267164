/* kvevents.transport.zmq._zmqio: the replay server's socket work, off the GIL.
 *
 * Why: the replay server runs on a thread of the engine's process. Under hostile replay traffic
 * (thousands of malformed requests a second, clients asking for the whole ring again and again)
 * its Python work per received message and per sent frame held the GIL that the engine thread's
 * publish() needs. Here one call receives and checks a whole burst of requests, or sends a whole
 * chunk of batches, with the GIL released for all of it; the replay policy (rate limits, byte
 * accounting, fairness) stays in Python (kvevents/transport/zmq/replay.py).
 *
 * libzmq is the one pyzmq already loaded into this process: bind(path) dlopens that file with
 * RTLD_NOLOAD (never a second copy) and looks up the few functions used; pyzmq's socket handle
 * (zmq.Socket.underlying) is then valid for them. Optional: kvevents/transport/zmq/_zmqio_py.py
 * falls back to pure Python where this module was not built or bind() fails.
 *
 * poll_requests(handle, timeout_ms, max, budget=-1) -> (requests, malformed, errno)
 *     Receives from a ROUTER socket until at least one well-formed replay request
 *     [identity, b"", 8-byte big-endian start] came (up to `max` of them, as (identity, start)),
 *     or `timeout_ms` passed (0: only what is there now); any other shape is only counted, so a
 *     flood of malformed requests never wakes a Python thread. `budget` >= 0: at most that many
 *     messages of any shape are received (the server's global request cap; what is left stays
 *     queued in libzmq, whose bounded pipe then pushes back on the senders). errno: 0, or the
 *     libzmq error that stopped it.
 * send_round(handle, jobs, overhead) -> [(sent, nbytes, tracker | None, errno), ...]
 *     jobs[j] = (ident, items): sends items[k] = (seq, topic, payload) as
 *     [ident, b"", topic, seq, payload] each, in order, stopping at the first that cannot go
 *     (errno: EAGAIN at the high-water mark, EHOSTUNREACH for a client gone; nothing of that
 *     message was queued); all jobs in one call (one round of the fair schedule). The last
 *     payload of a job, when it went, is a tracked message: the Tracker's `done` turns true when
 *     libzmq lets go of it. nbytes: the sent items' len(payload) + len(topic) + overhead.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "_zmqlib.h"

/* ---- Tracker: done once libzmq released the tracked message ---------------------------------- */

typedef struct {
    int refs; /* the Python object and libzmq's message: whoever lets go last frees it */
    int done;
    unsigned char data[];
} tbuf;

static void tbuf_unref(tbuf *b) {
    if (__atomic_sub_fetch(&b->refs, 1, __ATOMIC_ACQ_REL) == 0)
        free(b);
}

static void tbuf_released(void *data, void *hint) { /* libzmq's free callback (its I/O thread) */
    (void)data;
    tbuf *b = hint;
    __atomic_store_n(&b->done, 1, __ATOMIC_RELEASE);
    tbuf_unref(b);
}

typedef struct {
    PyObject_HEAD
    tbuf *buf;
} TrackerObject;

static void tracker_dealloc(TrackerObject *self) {
    if (self->buf)
        tbuf_unref(self->buf);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *tracker_done(TrackerObject *self, void *closure) {
    (void)closure;
    return PyBool_FromLong(__atomic_load_n(&self->buf->done, __ATOMIC_ACQUIRE));
}

static PyGetSetDef tracker_getset[] = {
    {"done", (getter)tracker_done, NULL, "True once libzmq let go of the message (it left)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject TrackerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvevents.transport.zmq._zmqio.Tracker",
    .tp_basicsize = sizeof(TrackerObject),
    .tp_dealloc = (destructor)tracker_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A sent message's release by libzmq (like pyzmq's MessageTracker).",
    .tp_getset = tracker_getset,
};

/* ---- bind ------------------------------------------------------------------------------------ */

static PyObject *zio_bind(PyObject *mod, PyObject *arg) {
    (void)mod;
    return zmqlib_bind(arg);
}

/* ---- poll_requests --------------------------------------------------------------------------- */

typedef struct {
    uint64_t start;
    size_t idlen;
    unsigned char id[256]; /* a ROUTER identity is 1..255 bytes */
} req_t;

/* one message off the socket (its first frame already in `m`): a request into *r, or not */
static int take_request(void *sock, zmsg *m, req_t *r, int *err) {
    size_t n = Z.msg_size(m);
    int ok = n >= 1 && n <= sizeof r->id, frames = 1;
    if (ok) {
        memcpy(r->id, Z.msg_data(m), n);
        r->idlen = n;
    }
    while (Z.msg_more(m)) { /* the rest of a multipart message is there already */
        Z.msg_close(m);
        Z.msg_init(m);
        if (Z.msg_recv(m, sock, 0) < 0) {
            *err = Z.errno_();
            return 0;
        }
        size_t sz = Z.msg_size(m);
        if (++frames == 2)
            ok = ok && sz == 0;
        else if (frames == 3 && ok && sz == 8) {
            const unsigned char *d = Z.msg_data(m);
            uint64_t v = 0;
            for (int k = 0; k < 8; k++)
                v = (v << 8) | d[k];
            r->start = v;
        } else
            ok = 0;
    }
    return ok && frames == 3;
}

static long long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static PyObject *zio_poll_requests(PyObject *mod, PyObject *args) {
    (void)mod;
    PyObject *handle;
    long timeout;
    Py_ssize_t max, budget = -1;
    if (!PyArg_ParseTuple(args, "Oln|n", &handle, &timeout, &max, &budget))
        return NULL;
    void *sock = sock_of(handle);
    if (!sock)
        return NULL;
    if (max < 1 || max > 4096 || timeout < 0)
        return PyErr_Format(PyExc_ValueError, "max must be in 1..4096 and timeout >= 0, got %zd, %ld", max, timeout);
    if (budget == 0)
        return Py_BuildValue("([]ni)", (Py_ssize_t)0, 0);
    req_t *reqs = PyMem_RawMalloc(sizeof(req_t) * (size_t)max);
    if (!reqs)
        return PyErr_NoMemory();
    Py_ssize_t nreq = 0, malformed = 0;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    long long deadline = now_ms() + timeout;
    zmsg m;
    for (;;) {
        Z.msg_init(&m);
        if (Z.msg_recv(&m, sock, Z_DONTWAIT) < 0) {
            int e = Z.errno_();
            Z.msg_close(&m);
            if (e != EAGAIN) {
                err = e == EINTR ? 0 : e; /* a signal: back to Python, which handles it */
                break;
            }
            long long left = deadline - now_ms();
            if (nreq || left <= 0)
                break;
            zpollitem item = {sock, 0, Z_POLLIN, 0};
            int rc = Z.poll(&item, 1, (long)left);
            if (rc <= 0) {
                int pe = rc < 0 ? Z.errno_() : 0;
                err = pe == EINTR ? 0 : pe;
                break;
            }
            continue;
        }
        if (take_request(sock, &m, &reqs[nreq], &err))
            nreq++;
        else
            malformed++;
        Z.msg_close(&m);
        if (err || nreq == max || nreq + malformed == budget)
            break;
    }
    Py_END_ALLOW_THREADS
    PyObject *list = PyList_New(nreq);
    for (Py_ssize_t i = 0; list && i < nreq; i++) {
        PyObject *t = Py_BuildValue("(y#K)", (const char *)reqs[i].id, (Py_ssize_t)reqs[i].idlen,
                                    (unsigned long long)reqs[i].start);
        if (!t)
            Py_CLEAR(list);
        else
            PyList_SET_ITEM(list, i, t);
    }
    PyMem_RawFree(reqs);
    if (!list)
        return NULL;
    return Py_BuildValue("(Nni)", list, malformed, err);
}

/* ---- send_round ------------------------------------------------------------------------------ */

typedef struct {
    const char *topic, *payload;
    Py_ssize_t tlen, plen;
    unsigned char seq[8];
} item_t;

typedef struct {
    Py_buffer ident;
    item_t *its;
    Py_ssize_t n, sent, nbytes;
    tbuf *tb;
    int err, tracked;
} job_t;

/* a job's items as pointers into the caller's bytes (the job list, ours, holds them alive and
 * unchanged while the GIL is released) and a copy of the last payload for the tracked message */
static int job_prepare(job_t *job, PyObject *spec) {
    PyObject *items;
    if (!PyTuple_Check(spec) || !PyArg_ParseTuple(spec, "y*O!", &job->ident, &PyList_Type, &items)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "a job is (ident bytes, items list)");
        return -1;
    }
    Py_ssize_t n = job->n = PyList_GET_SIZE(items);
    if (!n)
        return 0;
    if (!(job->its = PyMem_RawMalloc(sizeof(item_t) * (size_t)n))) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *t = PyList_GET_ITEM(items, k);
        if (!PyTuple_CheckExact(t) || PyTuple_GET_SIZE(t) != 3 || !PyBytes_CheckExact(PyTuple_GET_ITEM(t, 1)) ||
            !PyBytes_CheckExact(PyTuple_GET_ITEM(t, 2))) {
            PyErr_Format(PyExc_TypeError, "items[%zd] is not a (seq, topic bytes, payload bytes) tuple", k);
            return -1;
        }
        uint64_t seq = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(t, 0));
        if (seq == (uint64_t)-1 && PyErr_Occurred())
            return -1;
        item_t *it = &job->its[k];
        for (int b = 7; b >= 0; b--, seq >>= 8)
            it->seq[b] = (unsigned char)seq;
        it->topic = PyBytes_AS_STRING(PyTuple_GET_ITEM(t, 1));
        it->tlen = PyBytes_GET_SIZE(PyTuple_GET_ITEM(t, 1));
        it->payload = PyBytes_AS_STRING(PyTuple_GET_ITEM(t, 2));
        it->plen = PyBytes_GET_SIZE(PyTuple_GET_ITEM(t, 2));
    }
    if (!(job->tb = malloc(sizeof(tbuf) + (size_t)job->its[n - 1].plen + 1))) {
        PyErr_NoMemory();
        return -1;
    }
    job->tb->refs = 1; /* ours until the message owns a reference too */
    job->tb->done = 0;
    memcpy(job->tb->data, job->its[n - 1].payload, (size_t)job->its[n - 1].plen);
    return 0;
}

/* no GIL here */
static void job_send(void *sock, job_t *job, Py_ssize_t overhead) {
    for (Py_ssize_t k = 0; k < job->n; k++) {
        item_t *it = &job->its[k];
        /* at the high-water mark (EAGAIN) or for a client gone (EHOSTUNREACH with
         * ROUTER_MANDATORY) the identity frame fails and nothing of the message is queued; once
         * it went, the rest of the message always goes */
        if (Z.send(sock, job->ident.buf, (size_t)job->ident.len, Z_SNDMORE | Z_DONTWAIT) < 0 ||
            Z.send(sock, "", 0, Z_SNDMORE) < 0 || Z.send(sock, it->topic, (size_t)it->tlen, Z_SNDMORE) < 0 ||
            Z.send(sock, it->seq, 8, Z_SNDMORE) < 0) {
            job->err = Z.errno_();
            return;
        }
        if (k == job->n - 1) {
            zmsg m;
            tbuf *tb = job->tb;
            __atomic_add_fetch(&tb->refs, 1, __ATOMIC_ACQ_REL);
            if (Z.msg_init_data(&m, tb->data, (size_t)it->plen, tbuf_released, tb) < 0) {
                job->err = Z.errno_();
                __atomic_sub_fetch(&tb->refs, 1, __ATOMIC_ACQ_REL); /* never owned by a message */
                return;
            }
            if (Z.msg_send(&m, sock, 0) < 0) {
                job->err = Z.errno_();
                Z.msg_close(&m); /* not sent: released now */
                return;
            }
            job->tracked = 1;
        } else if (Z.send(sock, it->payload, (size_t)it->plen, 0) < 0) {
            job->err = Z.errno_();
            return;
        }
        job->sent++;
        job->nbytes += it->plen + it->tlen + overhead;
    }
}

static PyObject *job_result(job_t *job) {
    PyObject *tracker = Py_None;
    if (job->tb && job->tracked) {
        TrackerObject *t = PyObject_New(TrackerObject, &TrackerType);
        if (!t)
            return NULL;
        t->buf = job->tb; /* our reference goes to the Python object */
        job->tb = NULL;
        tracker = (PyObject *)t;
    } else
        Py_INCREF(Py_None);
    return Py_BuildValue("(nnNi)", job->sent, job->nbytes, tracker, job->err);
}

static PyObject *zio_send_round(PyObject *mod, PyObject *args) {
    (void)mod;
    PyObject *handle, *jobs_list, *out = NULL;
    Py_ssize_t overhead;
    if (!PyArg_ParseTuple(args, "OO!n", &handle, &PyList_Type, &jobs_list, &overhead))
        return NULL;
    void *sock = sock_of(handle);
    if (!sock)
        return NULL;
    Py_ssize_t nj = PyList_GET_SIZE(jobs_list);
    job_t *jobs = PyMem_RawCalloc(nj ? (size_t)nj : 1, sizeof(job_t));
    if (!jobs)
        return PyErr_NoMemory();
    Py_ssize_t ready = 0;
    for (; ready < nj; ready++)
        if (job_prepare(&jobs[ready], PyList_GET_ITEM(jobs_list, ready)) < 0)
            break;
    if (ready == nj) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t j = 0; j < nj; j++)
            job_send(sock, &jobs[j], overhead);
        Py_END_ALLOW_THREADS
        out = PyList_New(nj);
        for (Py_ssize_t j = 0; out && j < nj; j++) {
            PyObject *r = job_result(&jobs[j]);
            if (!r)
                Py_CLEAR(out);
            else
                PyList_SET_ITEM(out, j, r);
        }
    }
    for (Py_ssize_t j = 0; j < nj && j <= ready; j++) { /* the one that failed to prepare included */
        if (jobs[j].ident.obj)
            PyBuffer_Release(&jobs[j].ident);
        PyMem_RawFree(jobs[j].its);
        if (jobs[j].tb)
            tbuf_unref(jobs[j].tb);
    }
    PyMem_RawFree(jobs);
    return out;
}

static PyMethodDef zio_methods[] = {
    {"bind", zio_bind, METH_O, "bind(libzmq_path) -> (major, minor, patch): use the libzmq loaded from that file"},
    {"poll_requests", zio_poll_requests, METH_VARARGS,
     "poll_requests(handle, timeout_ms, max, budget=-1) -> (requests, malformed, errno): wait for replay requests"},
    {"send_round", zio_send_round, METH_VARARGS,
     "send_round(handle, jobs, overhead) -> [(sent, nbytes, tracker | None, errno), ...]"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef zio_module = {
    PyModuleDef_HEAD_INIT, "kvevents.transport.zmq._zmqio",
    "The replay server's socket work with the GIL released (see the C source's header).", -1, zio_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__zmqio(void) {
    if (PyType_Ready(&TrackerType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&zio_module);
    if (!m)
        return NULL;
    Py_INCREF(&TrackerType);
    if (PyModule_AddObject(m, "Tracker", (PyObject *)&TrackerType) < 0) {
        Py_DECREF(&TrackerType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
