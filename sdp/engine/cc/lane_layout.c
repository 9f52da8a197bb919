/* lane_layout.c: part of sdp's compiled fast-lane step, #included by lane_now.c (one translation unit,
 * not compiled alone: it uses what lane_now.c and the parts included before it define).
 *
 * The module's functions beside the Context: a flattened group's buffer (fusion.Layout: pack,
 * views), same_metas (a group's plan still holds), exportable and aligned_empty (64-byte aligned
 * arrays, for TensorFlow's DLPack and fusion.aligned_empty) and part_handles (a group's
 * PartHandles, made as burst() makes one).
 */

/* pack(arrays, out, starts) -> True, or False where Python must (a part not C-contiguous or of
 * another dtype, or not within out): each array copied into out (1-D, C-contiguous, writable)
 * at its element offset in starts (increasing), every gap before a start and after the last
 * part zeroed (fusion.Layout.pack's padding) */
static PyObject *lane_pack(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_Check(args[0]) || !PyArray_Check(args[1]) || !PyTuple_Check(args[2]))
        return PyErr_Format(PyExc_TypeError, "pack(list, array, tuple)"), NULL;
    PyArrayObject *out = (PyArrayObject *)args[1];
    Py_ssize_t n = PyList_GET_SIZE(args[0]);
    if (PyTuple_GET_SIZE(args[2]) != n || PyArray_NDIM(out) != 1 || !PyArray_IS_C_CONTIGUOUS(out) ||
        !PyArray_ISWRITEABLE(out))
        Py_RETURN_FALSE;
    PyArray_Descr *dt = PyArray_DESCR(out);
    Py_ssize_t item = PyArray_ITEMSIZE(out), total = PyArray_DIM(out, 0), end = 0;
    for (Py_ssize_t i = 0; i < n; i++) { /* (everything checked before the first byte moves) */
        PyObject *o = PyList_GET_ITEM(args[0], i);
        Py_ssize_t start = PyLong_AsSsize_t(PyTuple_GET_ITEM(args[2], i));
        if (start == -1 && PyErr_Occurred()) return NULL;
        if (!PyArray_Check(o)) Py_RETURN_FALSE;
        PyArrayObject *a = (PyArrayObject *)o;
        if (!PyArray_IS_C_CONTIGUOUS(a) || !PyArray_EquivTypes(PyArray_DESCR(a), dt) || start < end ||
            start > total || PyArray_SIZE(a) > total - start)
            Py_RETURN_FALSE;
        end = start + PyArray_SIZE(a);
    }
    char *base = PyArray_DATA(out); /* (the GIL kept: the list is the caller's) */
    end = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyArrayObject *a = (PyArrayObject *)PyList_GET_ITEM(args[0], i);
        Py_ssize_t start = PyLong_AsSsize_t(PyTuple_GET_ITEM(args[2], i)), size = PyArray_SIZE(a);
        if (start > end) memset(base + end * item, 0, (start - end) * item);
        memcpy(base + start * item, PyArray_DATA(a), size * item);
        end = start + size;
    }
    if (total > end) memset(base + end * item, 0, (total - end) * item);
    Py_RETURN_TRUE;
}

/* views(flat, spans) -> list: a view of flat (1-D, C-contiguous) per (start, end, shape or
 * None) of spans (fusion.Layout.spans), as flat[start:end] (reshaped to shape) */
static PyObject *lane_views(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyArray_Check(args[0]) || !PyList_Check(args[1]))
        return PyErr_Format(PyExc_TypeError, "views(array, list)"), NULL;
    return views_of((PyArrayObject *)args[0], args[1]);
}

static PyObject *views_of(PyArrayObject *flat, PyObject *spans) {
    if (PyArray_NDIM(flat) != 1 || !PyArray_IS_C_CONTIGUOUS(flat))
        return PyErr_Format(PyExc_ValueError, "views(): a 1-D C-contiguous array"), NULL;
    Py_ssize_t n = PyList_GET_SIZE(spans), total = PyArray_DIM(flat, 0), item = PyArray_ITEMSIZE(flat);
    PyObject *list = PyList_New(n);
    if (!list) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *span = PyList_GET_ITEM(spans, i), *shape;
        Py_ssize_t start, stop;
        npy_intp dims[NPY_MAXDIMS];
        int nd = 1;
        if (!PyTuple_Check(span) || PyTuple_GET_SIZE(span) != 3) goto bad;
        start = PyLong_AsSsize_t(PyTuple_GET_ITEM(span, 0)), stop = PyLong_AsSsize_t(PyTuple_GET_ITEM(span, 1));
        shape = PyTuple_GET_ITEM(span, 2);
        if (PyErr_Occurred() || start < 0 || stop < start || stop > total) goto bad;
        dims[0] = stop - start;
        if (shape != Py_None) {
            npy_intp count = 1;
            if (!PyTuple_Check(shape) || (nd = (int)PyTuple_GET_SIZE(shape)) > NPY_MAXDIMS) goto bad;
            for (int k = 0; k < nd; k++) count *= dims[k] = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, k));
            if (PyErr_Occurred() || count != stop - start) goto bad;
        }
        PyArray_Descr *dt = PyArray_DESCR(flat);
        Py_INCREF(dt);
        PyObject *v = PyArray_NewFromDescr(&PyArray_Type, dt, nd, dims, NULL, PyArray_BYTES(flat) + start * item,
                                           PyArray_FLAGS(flat) & (NPY_ARRAY_WRITEABLE | NPY_ARRAY_CARRAY), NULL);
        if (!v) goto fail;
        Py_INCREF(flat);
        if (PyArray_SetBaseObject((PyArrayObject *)v, (PyObject *)flat) < 0) {
            Py_DECREF(v);
            goto fail;
        }
        PyList_SET_ITEM(list, i, v);
    }
    return list;
bad:
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "views(): a bad span");
fail:
    Py_DECREF(list);
    return NULL;
}

/* same_metas(arrays, metas) -> whether every item of arrays (a list) is a numpy array of the dtype
 * and shape of metas' item (a list of (dtype, shape tuple)): a flattened group's plan still holds
 * (sdp.api._grouped_submit; 100 arrays ~1 us, where Python's list of (dtype, shape) compared ~17) */
static PyObject *lane_same_metas(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyList_Check(args[0]) || !PyList_Check(args[1]))
        return PyErr_Format(PyExc_TypeError, "same_metas(list, list)"), NULL;
    return PyBool_FromLong(metas_match(args[0], args[1], 0));
}

/* 1 when every item of arrays (a list) is a numpy array (C-contiguous too, with `contiguous`) of
 * the dtype and shape of the item of metas (a list of (dtype, shape tuple)) at its index, else 0 */
static int metas_match(PyObject *arrays, PyObject *metas, int contiguous) {
    Py_ssize_t n = PyList_GET_SIZE(arrays);
    if (PyList_GET_SIZE(metas) != n) return 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyList_GET_ITEM(arrays, i), *m = PyList_GET_ITEM(metas, i);
        if (!PyArray_CheckExact(o) || !PyTuple_Check(m) || PyTuple_GET_SIZE(m) != 2) return 0;
        PyArrayObject *a = (PyArrayObject *)o;
        PyObject *dt = PyTuple_GET_ITEM(m, 0), *shape = PyTuple_GET_ITEM(m, 1);
        if ((PyObject *)PyArray_DESCR(a) != dt &&
            (!PyArray_DescrCheck(dt) || !PyArray_EquivTypes(PyArray_DESCR(a), (PyArray_Descr *)dt)))
            return 0;
        int nd = PyArray_NDIM(a);
        if (!PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) != nd || (contiguous && !PyArray_IS_C_CONTIGUOUS(a)))
            return 0;
        for (int k = 0; k < nd; k++) {
            PyObject *d = PyTuple_GET_ITEM(shape, k);
            if (!PyLong_CheckExact(d) || PyLong_AsSsize_t(d) != PyArray_DIM(a, k)) {
                PyErr_Clear();
                return 0;
            }
        }
    }
    return 1;
}

/* exportable(a) -> whether a is a numpy array TensorFlow can wrap through DLPack as it is: not
 * empty, C-contiguous, writeable, its data on a 64-byte boundary (sdp.tensorflow.ops.as_output;
 * reading arr.ctypes.data alone takes ~1 us) */
static PyObject *lane_exportable(PyObject *mod, PyObject *o) {
    if (PyArray_Check(o)) {
        PyArrayObject *a = (PyArrayObject *)o;
        if (PyArray_SIZE(a) > 0 && PyArray_IS_C_CONTIGUOUS(a) && PyArray_ISWRITEABLE(a) &&
            (uintptr_t)PyArray_DATA(a) % 64 == 0)
            Py_RETURN_TRUE;
    }
    Py_RETURN_FALSE;
}

/* aligned_empty(dtype, count) -> a new 1-D array, ALIGN-byte aligned (fusion.aligned_empty's large case) */
static PyObject *lane_aligned_empty(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    PyArray_Descr *descr = NULL;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "aligned_empty(dtype, count)");
        return NULL;
    }
    npy_intp count = PyLong_AsSsize_t(args[1]);
    if (count == -1 && PyErr_Occurred()) return NULL;
    if (count < 0) {
        PyErr_SetString(PyExc_ValueError, "aligned_empty: a negative count");
        return NULL;
    }
    if (!PyArray_DescrConverter(args[0], &descr)) return NULL;
    return aligned_new(descr, 1, &count);
}

/* part_handles(cls, names, group) -> [cls(name, group, i) for i, name in enumerate(names)] (names a
 * list; cls PartHandle): a group's handles, made as Context.burst makes one */
static PyObject *lane_part_handles(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_Check(args[1]))
        return PyErr_Format(PyExc_TypeError, "part_handles(cls, list, group)"), NULL;
    Py_ssize_t offsets[3], n = PyList_GET_SIZE(args[1]);
    slot_offsets(args[0], offsets);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *index = PyLong_FromSsize_t(i), *h = NULL;
        if (index) h = part_handle_new(args[0], offsets, PyList_GET_ITEM(args[1], i), args[2], index);
        Py_XDECREF(index);
        if (!h) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, h);
    }
    return out;
}
