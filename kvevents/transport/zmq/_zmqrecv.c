/* kvevents.transport.zmq._zmqrecv: a subscriber's drain of one socket, and a publisher's live
 * sends of a group of batches, each in one call.
 *
 * Why: a live batch is three frames [topic, seq, payload]. Read frame by frame from Python
 * (pyzmq's recv, then getsockopt(RCVMORE), which builds an enum per call) it cost ~3.2 us per
 * batch, most of a subscriber's per-batch work for 16-event batches; the bridge and a router on
 * direct ZeroMQ both pay it. Here one call reads up to `max` whole messages, each as a list of
 * its frames' bytes, exactly what the Python loop builds; the checks stay in Python.
 *
 * libzmq is the one pyzmq already loaded into this process: bind(path) dlopens that file with
 * RTLD_NOLOAD (never a second copy) and looks up the functions used; pyzmq's socket handle
 * (zmq.Socket.underlying) is then valid for them. Optional: without it the Python loop runs.
 *
 * bind(path) -> (major, minor, patch)
 * drain(handle, max) -> (messages, dry, errno)
 *     Receives without waiting until `max` messages were read (1..4096), the socket has none
 *     left (dry True: EAGAIN on a message's first frame), or libzmq reports another error
 *     (errno, nonzero; the messages read before it are returned). The GIL is held: nothing
 *     here waits.
 * send_live(handle, items) -> (sent, nbytes, errno)
 *     The publisher's live path (kvevents/transport/zmq/publisher.py): items[k] = (seq, topic,
 *     payload, ...) goes out as [topic, seq (8 bytes big-endian), payload], in order, without
 *     waiting (a PUB socket drops at its high-water mark instead); stops at the first that
 *     fails (errno). Three pyzmq sends per batch cost ~2.4 us; here they cost the copies.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>

#include "_zmqlib.h"

static PyObject *zr_bind(PyObject *mod, PyObject *arg) {
    (void)mod;
    return zmqlib_bind(arg);
}

/* One frame into `frames` (a new bytes object); 0, or -1 with a Python error set. */
static int take(zmsg *m, PyObject *frames) {
    PyObject *b = PyBytes_FromStringAndSize((const char *)Z.msg_data(m), (Py_ssize_t)Z.msg_size(m));
    if (!b)
        return -1;
    int rc = PyList_Append(frames, b);
    Py_DECREF(b);
    return rc;
}

static PyObject *zr_drain(PyObject *mod, PyObject *args) {
    (void)mod;
    PyObject *handle;
    Py_ssize_t max;
    if (!PyArg_ParseTuple(args, "On", &handle, &max))
        return NULL;
    void *sock = sock_of(handle);
    if (!sock)
        return NULL;
    if (max < 1 || max > 4096)
        return PyErr_Format(PyExc_ValueError, "max must be in 1..4096, got %zd", max);
    PyObject *msgs = PyList_New(0);
    if (!msgs)
        return NULL;
    int dry = 0, err = 0;
    zmsg m;
    for (Py_ssize_t i = 0; i < max && !err; i++) {
        Z.msg_init(&m);
        if (Z.msg_recv(&m, sock, Z_DONTWAIT) < 0) {
            int e = Z.errno_();
            Z.msg_close(&m);
            if (e == EAGAIN)
                dry = 1;
            else if (e != EINTR)
                err = e;
            break;
        }
        PyObject *frames = PyList_New(0);
        if (!frames || take(&m, frames) < 0 || PyList_Append(msgs, frames) < 0) {
            Z.msg_close(&m);
            Py_XDECREF(frames);
            Py_DECREF(msgs);
            return NULL;
        }
        Py_DECREF(frames); /* msgs holds it */
        while (Z.msg_more(&m)) { /* the rest of a multipart message is there already (atomic) */
            Z.msg_close(&m);
            Z.msg_init(&m);
            if (Z.msg_recv(&m, sock, Z_DONTWAIT) < 0) {
                err = Z.errno_();
                break;
            }
            if (take(&m, frames) < 0) {
                Z.msg_close(&m);
                Py_DECREF(msgs);
                return NULL;
            }
        }
        Z.msg_close(&m);
    }
    PyObject *res = Py_BuildValue("(OOi)", msgs, dry ? Py_True : Py_False, err);
    Py_DECREF(msgs);
    return res;
}


/* One frame: 0, or the libzmq errno. */
static int send1(void *sock, const void *data, size_t n, int flags) {
    while (Z.send(sock, data, n, flags) < 0) {
        int e = Z.errno_();
        if (e != EINTR)
            return e;
    }
    return 0;
}

static PyObject *zr_send_live(PyObject *mod, PyObject *args) {
    (void)mod;
    PyObject *handle, *items;
    if (!PyArg_ParseTuple(args, "OO!", &handle, &PyList_Type, &items))
        return NULL;
    void *sock = sock_of(handle);
    if (!sock)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(items), sent = 0;
    long long nbytes = 0;
    int err = 0;
    for (; sent < n && !err; sent++) {
        PyObject *it = PyList_GET_ITEM(items, sent);
        if (!PyTuple_Check(it) || PyTuple_GET_SIZE(it) < 3 || !PyBytes_Check(PyTuple_GET_ITEM(it, 1)) ||
            !PyBytes_Check(PyTuple_GET_ITEM(it, 2)))
            return PyErr_Format(PyExc_TypeError, "send_live: item %zd is not (seq, topic bytes, payload bytes, ...)", sent);
        unsigned long long seq = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(it, 0));
        if (seq == (unsigned long long)-1 && PyErr_Occurred())
            return NULL;
        unsigned char sb[8];
        for (int i = 7; i >= 0; i--, seq >>= 8)
            sb[i] = (unsigned char)(seq & 0xff);
        PyObject *topic = PyTuple_GET_ITEM(it, 1), *payload = PyTuple_GET_ITEM(it, 2);
        /* the first frame decides: once it is queued, the others of the message go too */
        err = send1(sock, PyBytes_AS_STRING(topic), (size_t)PyBytes_GET_SIZE(topic), Z_DONTWAIT | Z_SNDMORE);
        if (err)
            break;
        err = send1(sock, sb, 8, Z_DONTWAIT | Z_SNDMORE);
        if (!err)
            err = send1(sock, PyBytes_AS_STRING(payload), (size_t)PyBytes_GET_SIZE(payload), Z_DONTWAIT);
        if (err)
            break;
        nbytes += PyBytes_GET_SIZE(payload);
    }
    return Py_BuildValue("(nLi)", sent, nbytes, err);
}

static PyMethodDef methods[] = {
    {"bind", zr_bind, METH_O, "bind(libzmq_path): use the libzmq loaded from that file"},
    {"drain", zr_drain, METH_VARARGS, "drain(handle, max) -> (messages, dry, errno)"},
    {"send_live", zr_send_live, METH_VARARGS, "send_live(handle, items) -> (sent, nbytes, errno)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_zmqrecv", "A subscriber socket's drain in one call.", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__zmqrecv(void) { return PyModule_Create(&module); }
