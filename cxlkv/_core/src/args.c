/*
 * Argument parsing shared by every file of the core: argument counts,
 * unsigned 64-bit ints, the tri-state nt flag, uint64 offset arrays.
 */
#include "core.h"

#include <string.h>

int
as_u64(PyObject *o, uint64_t *out, const char *what)
{
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, not %.100s", what,
                     Py_TYPE(o)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_Format(cxlkv_RangeError, "%s out of range: %R (must be 0 .. 2**64-1)", what, o);
        }
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

int
nargs_check(Py_ssize_t nargs, Py_ssize_t lo, Py_ssize_t hi, const char *name)
{
    if (nargs < lo || nargs > hi) {
        if (lo == hi)
            PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, lo, nargs);
        else
            PyErr_Format(PyExc_TypeError, "%s() takes %zd to %zd arguments (%zd given)", name,
                         lo, hi, nargs);
        return -1;
    }
    return 0;
}

/* tri-state nt argument: None -> mapping default by size */
int
parse_nt(Mapping *m, PyObject *o, uint64_t len, int *nt)
{
    if (o == NULL || o == Py_None) {
        *nt = m->nt_default && len >= m->nt_threshold;
        return 0;
    }
    int t = PyObject_IsTrue(o);
    if (t < 0)
        return -1;
    *nt = t;
    return 0;
}

/* A C-contiguous buffer of uint64 (numpy uint64); TypeError otherwise. */
int
get_offsets(PyObject *obj, Py_buffer *b, int writable)
{
    if (PyObject_GetBuffer(obj, b, (writable ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS |
                                   PyBUF_FORMAT) < 0)
        return -1;
    if (b->itemsize != 8 || (b->format && strcmp(b->format, "Q") && strcmp(b->format, "L") &&
                             strcmp(b->format, "<Q") && strcmp(b->format, "=Q") &&
                             strcmp(b->format, "K") && strcmp(b->format, "k"))) {
        PyErr_SetString(PyExc_TypeError, "offsets must be a buffer of uint64 (e.g. numpy uint64)");
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}
