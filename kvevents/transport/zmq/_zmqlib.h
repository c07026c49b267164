/* The libzmq that pyzmq already loaded, bound by hand: shared by _zmqio.c (the replay server)
 * and _zmqrecv.c (the live path). Each extension includes it once and gets its own table.
 *
 * zmqlib_bind(path) dlopens that file with RTLD_NOLOAD (never a second copy of libzmq in the
 * process) and looks up every function either extension uses; pyzmq's socket handle
 * (zmq.Socket.underlying) is then valid for them. Returns (major, minor, patch), or NULL with
 * OSError naming the file and what is missing. The handle is kept: the library stays loaded as
 * long as pyzmq's module does. */
#ifndef KVEVENTS_ZMQLIB_H
#define KVEVENTS_ZMQLIB_H

#include <Python.h>
#include <dlfcn.h>

/* zmq_msg_t is 64 opaque bytes, pointer-aligned, in every libzmq 4.x (the ABI pyzmq uses) */
typedef struct { unsigned char _[64]; } __attribute__((aligned(sizeof(void *)))) zmsg;
typedef void (zfree_fn)(void *data, void *hint);
typedef struct {
    void *socket;
    int fd;
    short events, revents;
} zpollitem;

#define Z_DONTWAIT 1
#define Z_SNDMORE 2
#define Z_POLLIN 1

static struct {
    void (*version)(int *, int *, int *);
    int (*errno_)(void);
    int (*msg_init)(zmsg *);
    int (*msg_init_data)(zmsg *, void *, size_t, zfree_fn *, void *);
    int (*msg_recv)(zmsg *, void *, int);
    int (*msg_send)(zmsg *, void *, int);
    int (*msg_close)(zmsg *);
    void *(*msg_data)(zmsg *);
    size_t (*msg_size)(const zmsg *);
    int (*msg_more)(const zmsg *);
    int (*send)(void *, const void *, size_t, int);
    int (*poll)(zpollitem *, int, long);
} Z;
static int bound = 0;

static PyObject *zmqlib_bind(PyObject *arg) {
    PyObject *path = NULL;
    if (!PyUnicode_FSConverter(arg, &path))
        return NULL;
    void *lib = dlopen(PyBytes_AS_STRING(path), RTLD_NOW | RTLD_NOLOAD);
    Py_DECREF(path);
    if (!lib)
        return PyErr_Format(PyExc_OSError, "libzmq is not loaded from %R: %s", arg, dlerror());
#define SYM(field, name)                                                                     \
    if (!(*(void **)&Z.field = dlsym(lib, name)))                                            \
        return PyErr_Format(PyExc_OSError, "%R has no %s", arg, name);
    SYM(version, "zmq_version")
    SYM(errno_, "zmq_errno")
    SYM(msg_init, "zmq_msg_init")
    SYM(msg_init_data, "zmq_msg_init_data")
    SYM(msg_recv, "zmq_msg_recv")
    SYM(msg_send, "zmq_msg_send")
    SYM(msg_close, "zmq_msg_close")
    SYM(msg_data, "zmq_msg_data")
    SYM(msg_size, "zmq_msg_size")
    SYM(msg_more, "zmq_msg_more")
    SYM(send, "zmq_send")
    SYM(poll, "zmq_poll")
#undef SYM
    int major, minor, patch;
    Z.version(&major, &minor, &patch);
    if (major != 4)
        return PyErr_Format(PyExc_OSError, "libzmq %d.%d.%d: only 4.x has the message layout used here", major,
                            minor, patch);
    bound = 1;
    return Py_BuildValue("(iii)", major, minor, patch);
}

/* pyzmq's socket handle (zmq.Socket.underlying) as a pointer, once bind() succeeded; NULL with
 * a Python error set otherwise. */
static void *sock_of(PyObject *handle) {
    if (!bound) {
        PyErr_SetString(PyExc_RuntimeError, "bind() was not called");
        return NULL;
    }
    void *s = PyLong_AsVoidPtr(handle);
    if (!s && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "a null socket handle");
    return s;
}

#endif
