/* kvevents.transport.zmq._zmqrecv: a subscriber's drain of one socket in one call.
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


static PyMethodDef methods[] = {
    {"bind", zr_bind, METH_O, "bind(libzmq_path): use the libzmq loaded from that file"},
    {"drain", zr_drain, METH_VARARGS, "drain(handle, max) -> (messages, dry, errno)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_zmqrecv", "A subscriber socket's drain in one call.", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__zmqrecv(void) { return PyModule_Create(&module); }
