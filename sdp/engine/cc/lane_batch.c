/* lane_batch.c: part of sdp's compiled fast-lane step, #included by lane_now.c (one translation unit,
 * not compiled alone: it uses what lane_now.c and the parts included before it define).
 *
 * The batch's entries: ctx.burst (Lane.burst whole: an allreduce_async joins the batch being
 * gathered, and its PartHandle is returned) and ctx.flush (Lane.flush's common case whole: a
 * learnt batch's positions posted, polled for and reduced through run_posted), with a batch's
 * fields read once per batch (batch_fields).
 */

static void forget_batch(Ctx *c) {
    c->b_until = 0.0;
    Py_CLEAR(c->batch); Py_CLEAR(c->b_arrays); Py_CLEAR(c->b_names); Py_CLEAR(c->b_order);
    Py_CLEAR(c->b_handle); Py_CLEAR(c->b_dtype); Py_CLEAR(c->b_op);
}

/* c->b_*: batch b's fields (read once per batch: a _Batch keeps these objects), 0 or -1 */
static int batch_fields(Ctx *c, PyObject *b) {
    if (b == c->batch) return 0;
    forget_batch(c);
    PyObject *ps = PyObject_GetAttr(b, S_postscale);
    c->b_postscale = ps ? PyFloat_AsDouble(ps) : 0.0;
    Py_XDECREF(ps);
    if (!(c->b_arrays = PyObject_GetAttr(b, S_arrays)) ||
        !(c->b_names = PyObject_GetAttr(b, S_names)) || !(c->b_order = PyObject_GetAttr(b, S_order)) ||
        !(c->b_handle = PyObject_GetAttr(b, S_handle)) || !(c->b_dtype = PyObject_GetAttr(b, S_dtype)) ||
        !(c->b_op = PyObject_GetAttr(b, S_op)) || PyErr_Occurred() ||
        !PyList_Check(c->b_arrays) || !PyDict_Check(c->b_names) || !PyList_Check(c->b_order) ||
        !PyArray_DescrCheck(c->b_dtype)) {
        forget_batch(c);
        return PyErr_Occurred() ? -1 : (PyErr_SetString(PyExc_TypeError, "not a _Batch"), -1);
    }
    Py_INCREF(b);
    c->batch = b;
    return 0;
}

/* _Batch.fits(name, a, op, postscale, size) for batch b: 1, 0, -1 error; *held: b.nbytes */
static int batch_fits(Ctx *c, PyObject *b, PyObject *name, PyArrayObject *arr, PyObject *op, double postscale,
                      int64_t *held) {
    if (batch_fields(c, b) < 0) return -1;
    int64_t nbytes = PyArray_NBYTES(arr);
    *held = int_attr(b, S_nbytes);
    if (PyErr_Occurred()) return -1;
    if (!((PyObject *)PyArray_DESCR(arr) == c->b_dtype ||
          PyArray_EquivTypes(PyArray_DESCR(arr), (PyArray_Descr *)c->b_dtype)) ||
        op != c->b_op || postscale != c->b_postscale || PyList_GET_SIZE(c->b_arrays) >= c->batch_max ||
        nbytes <= 0 || (*held + nbytes + ALIGN) * (c->size - 1) > c->read_bytes)
        return 0;
    int in = PyDict_Contains(c->b_names, name);
    return in < 0 ? -1 : !in;
}

/* _Batch.add_part(name, a) for batch b (it fits; held: b.nbytes), and lane._active_until as
 * Lane.burst sets it (here only once a quarter of GRACE_S passed since it last did for this batch:
 * Python only raises it while the batch is open): the PartHandle, or NULL (error) */
static PyObject *batch_add(Ctx *c, PyObject *b, PyObject *name, PyArrayObject *arr, int64_t held) {
    double until = now_s() + c->grace_s;
    PyObject *index = NULL, *h = NULL, *u = NULL;
    if (until > c->b_until + c->grace_s / 4) {
        if (!(u = PyFloat_FromDouble(until)) || PyObject_SetAttr(c->lane, S_active_until, u) < 0) {
            Py_XDECREF(u);
            return NULL;
        }
        Py_DECREF(u);
        c->b_until = until;
    }
    if (PyList_Append(c->b_arrays, (PyObject *)arr) == 0 && PyDict_SetItem(c->b_names, name, b) == 0 &&
        PyList_Append(c->b_order, name) == 0 && set_int(b, S_nbytes, held + PyArray_NBYTES(arr) + ALIGN) == 0 &&
        (index = PyLong_FromSsize_t(PyList_GET_SIZE(c->b_arrays) - 1)))
        h = part_handle_new(c->part_handle, c->part_slots, name, c->b_handle, index);
    Py_XDECREF(index);
    return h;
}

/* lane._head_to_learn() when lane._head is set (Lane.post's fast path): 0, -1 error */
static int learn_head(PyObject *L) {
    int none = attr_is(L, S_head, IS_NONE);
    if (none != 0) return none < 0 ? -1 : 0;
    PyObject *r = PyObject_CallMethodNoArgs(L, S_head_to_learn);
    Py_XDECREF(r);
    return r ? 0 : -1;
}

/* ctx.burst(name, a, op, postscale) -> a PartHandle, or None (nothing done: the caller submits
 * as usual) -- Lane.burst whole: the allreduce of a (a C-contiguous numpy array, postscale a
 * float) joins the batch being gathered (lane._batch) if it fits (_Batch.fits, checked with the
 * lane's lock held, as is the lane: not failed or off; a burst's first submission learnt first). */
static PyObject *ctx_burst(Ctx *c, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) return PyErr_Format(PyExc_TypeError, "burst() takes 4 arguments"), NULL;
    PyObject *name = args[0], *a = args[1], *op = args[2], *ps = args[3];
    if (!c->lane || !c->part_handle || !PyUnicode_CheckExact(name) || !PyArray_CheckExact(a) ||
        !PyFloat_CheckExact(ps) || !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)a))
        Py_RETURN_NONE;
    PyObject *L = c->lane, *got = PyObject_Vectorcall(c->acquire, NULL, 0, NULL); /* (blocking, as `with lane.lock`) */
    if (!got) return NULL;
    Py_DECREF(got);
    PyObject *b = PyObject_GetAttr(L, S_batch), *h = NULL;
    int ok = b && b != Py_None && attr_is(L, S_failed, IS_NONE) == 1 && attr_is(L, S_off, IS_TRUE) == 0 &&
             learn_head(L) == 0;
    int64_t held = 0;
    if (ok && (ok = batch_fits(c, b, name, (PyArrayObject *)a, op, PyFloat_AS_DOUBLE(ps), &held)) == 1)
        h = batch_add(c, b, name, (PyArrayObject *)a, held);
    Py_XDECREF(b);
    if (unlock(c) < 0 || (!h && PyErr_Occurred())) {
        Py_XDECREF(h);
        return NULL;
    }
    if (!h) Py_RETURN_NONE;
    return h;
}

/* 1 when batch b (its fields c->b_*, n arrays) is what entry g was learnt from: the same names,
 * dtypes and shapes (each array C-contiguous), op and postscale; 0 when not, -1 error */
static int batch_matches(Ctx *c, GEntry *g, Py_ssize_t n) {
    if (g->n != n || c->b_op != g->op || c->b_postscale != g->postscale || PyList_GET_SIZE(c->b_order) != n) return 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyList_GET_ITEM(c->b_order, i), *y = PyTuple_GET_ITEM(g->names, i);
        if (x != y && (!PyUnicode_CheckExact(x) || PyUnicode_Compare(x, y) != 0)) return PyErr_Occurred() ? -1 : 0;
    }
    return metas_match(c->b_arrays, g->metas, 1);
}

/* ctx.flush(b, spin) -> the list of b's results, True (posted: Lane._finish_batch holds it), or
 * None (nothing posted: Lane.flush posts it in Python) -- Lane.flush's common case whole, from a
 * caller that waits on (spin true: it polls up to lane.spin_s) or polls a request of batch b: b is
 * lane._batch and learnt (learn_batch(): the same names, dtypes and shapes, each C-contiguous, op
 * and postscale), nothing else held or deferred here, room for its m positions.  They are posted
 * as Lane._flush_batch posts them (the first with the batch's copy, packed here) and polled for;
 * consumed FAST without a doorbell, the copies are reduced into one new array whose views
 * _Batch.done gets (under the lock), else Lane._finish_batch goes on. */
static PyObject *ctx_flush(Ctx *c, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "flush() takes 2 arguments"), NULL;
    PyObject *b = args[0], *L = c->lane, *cap = NULL, *cur;
    int want_spin = PyObject_IsTrue(args[1]), locked, ok, busy = 1;
    if (want_spin < 0) return NULL;
    if (!L || !c->bcache || !c->finish_b) Py_RETURN_NONE;
    if ((locked = try_lock(c)) != 1) return locked < 0 ? NULL : (Py_INCREF(Py_None), Py_None);
    GEntry *g = NULL;
    int64_t p = 0, off = -1;
    double spin = 0.0;
    Py_ssize_t n = 0;
    ok = (cur = PyObject_GetAttr(L, S_batch)) == b && lane_free(L) == 1 && learn_head(L) == 0 &&
         batch_fields(c, b) == 0;
    Py_XDECREF(cur);
    if (ok && (n = PyList_GET_SIZE(c->b_arrays)) >= 2 && PyList_GET_SIZE(c->b_order) == n &&
        (cap = PyDict_GetItemWithError(c->bcache, PyList_GET_ITEM(c->b_order, 0))))
        g = PyCapsule_GetPointer(cap, NULL);
    if (g && batch_matches(c, g, n) == 1 && (p = int_attr(L, S_posted)) >= 0 && room(c, p, p + n - 1) == 1 &&
        spin_of(c, &spin, &busy) == 0)
        off = alloc_at(c, g->count * ITEM[g->red >> 2], p);
    if (off < 0) { /* not learnt, not idle, no room, or an error */
        if (unlock(c) < 0 || PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    /* (held: the entry, which learn_batch may replace, and the arrays, while the GIL is let go) */
    PyObject *held = c->b_arrays;
    Part *parts = PyMem_Malloc(n * sizeof(Part));
    if (!parts) {
        unlock(c);
        return PyErr_NoMemory();
    }
    Py_INCREF(held), Py_INCREF(cap), Py_INCREF(b);
    for (Py_ssize_t i = 0; i < n; i++)
        parts[i] = (Part){PyArray_DATA((PyArrayObject *)PyList_GET_ITEM(held, i)), g->starts[i], g->sizes[i]};
    Front f = {g->group, g->sig, g->red, g->scale, g->count * ITEM[g->red >> 2], NULL, Py_None, g, parts,
               {held, c->b_op, Py_None, Py_None}, b, n};
    PyObject *r = run_posted(c, &f, p, off, busy, want_spin ? spin : 0.0);
    Py_DECREF(cap), Py_DECREF(held), Py_DECREF(b), PyMem_Free(parts);
    return r;
}
