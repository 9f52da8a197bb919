/* lane_step.c: part of sdp's compiled fast-lane step, #included by lane_now.c (one translation unit,
 * not compiled alone: it uses what lane_now.c and the parts included before it define).
 *
 * One position in one call: copy_in (an input into this rank's data ring, through the caches),
 * step (post: copy, record, LATEST, POSTED; poll: look, spinning with the GIL released for up to
 * the spin; reduce: every rank's copy into the result once consumed FAST; the ranks to ring) and
 * the module's now() (Lane.allreduce_now's step, the offset and result given by Python), with
 * group_parts for a flattened group's input read from its arrays.
 */

/* copy into shared memory another core reads next, through the caches: sdprun sets glibc's
 * non-temporal memcpy threshold to 128 KB for the engine's big copies (sdp/launcher/jobenv.py),
 * and a 256 KB lane copy that bypasses the caches made the allreduce 39 us instead of 29 here;
 * x86's "rep movsb" (fast strings) keeps the lines cached at every size */
static void copy_in(char *dst, const char *src, size_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
    __asm__ volatile("rep movsb" : "+D"(dst), "+S"(src), "+c"(n) : : "memory");
#else
    memcpy(dst, src, n);
#endif
}

/* post position p (copy src unless NULL, record, LATEST, POSTED; a batch: m positions, the parts'
 * records written already), poll for up to spin seconds and, when consumed FAST, reduce every
 * rank's copy into dst: returns the code; *ringp: the ranks to ring (rank 0's bit 0: posts wait
 * for Lane._decide); *to (rank 0): the positions decided */
static int step(Ctx *c, int64_t p, int64_t m, int64_t sig, int64_t off, const char *src, Py_ssize_t nbytes,
                char *dst, int red, double scale, double spin, int64_t decided, int64_t awake, uint64_t *ringp,
                int64_t *to, const Part *parts, Py_ssize_t nparts) {
    int me = c->rank, code = 0;
    uint64_t ring = 0;
    Py_ssize_t item = ITEM[red >> 2];
    volatile int64_t *mine = c->page[me];
    int64_t i = (p % c->depth) * c->rec_n;
    if (src) copy_in(c->data[me] + off, src, nbytes);
    c->rec[me][i] = sig, c->rec[me][i + 1] = off, c->rec[me][i + 2] = nbytes;
    STORE(mine[c->latest], p + m);
    STORE(mine[c->posted], p + m); /* last: the records are visible before their count */
    if (me != 0) { /* Lane._ring_sleepers: a rank asleep on a lane handle that may act on this post */
        FENCE();
        for (int q = 0; q < c->size; q++)
            if (q != me && LOAD(c->page[q][c->waiting]) && (q == 0 || LOAD(c->page[q][c->posted]) >= p + m))
                ring |= 1ULL << q;
        if (ring) code = R_PYTHON;
    }
    if (!code) {
        STORE(mine[c->awake], awake + 1);
        code = look(c, p, m, sig, decided, &ring, to);
        if (!code && spin > 0) {
            Py_BEGIN_ALLOW_THREADS
            double end = now_s() + spin;
            do {
                sched_yield();
                code = look(c, p, m, sig, decided, &ring, to);
            } while (!code && now_s() < end);
            Py_END_ALLOW_THREADS
        }
        STORE(mine[c->awake], awake);
        STORE(mine[c->rung], 0);
        if (me == 0) { /* (as Lane._poll_now: a peer's doorbell skipped while we polled is not lost) */
            FENCE();
            for (int q = 1; q < c->size; q++)
                if (LOAD(c->page[q][c->posted]) > LOAD(mine[c->decided])) ring |= 1; /* bit 0: decide */
        }
    }
    if (code == R_FAST) {
        char *from[MAX_RANKS];
        for (int q = 0; q < c->size; q++) {
            int64_t qoff = c->rec[q][i + 1], got = c->rec[q][i + 2];
            if (got != nbytes || qoff % item || qoff < 0 || qoff > c->data_bytes - nbytes) code = R_RECORD;
            from[q] = c->data[q] + qoff;
        }
        /* this rank's copy: the same bytes read where this core last read them, not where copy_in
         * just stored them (64 KB: ~2 us less); not when the input is the result (a later rank's
         * operand would be overwritten by the first pass) */
        if (src && (me == 0 || src + nbytes <= dst || dst + nbytes <= src)) from[me] = (char *)src;
        if (code == R_FAST) {
            Py_BEGIN_ALLOW_THREADS
            if (parts)
                reduce_parts(red, from, c->size, me, dst, nbytes / item, scale, parts, nparts);
            else
                reduce(red, from, c->size, dst, nbytes / item, scale);
            Py_END_ALLOW_THREADS
        }
    }
    *ringp = ring;
    return code;
}

/* the parts of (arrays, starts) (a group's list and fusion.Layout.starts) this rank's operand can be
 * read from (C-contiguous, dst's dtype, in order within dst's count, apart from dst), each array
 * referenced in *held (a new list: another thread may change the caller's while the GIL is let go);
 * returns how many, -1 with an error set */
static Py_ssize_t group_parts(PyObject *group, PyArrayObject *dst, Part **parts, PyObject **held) {
    PyObject *arrays = PyTuple_GET_ITEM(group, 0), *starts = PyTuple_GET_ITEM(group, 1);
    if (!PyList_Check(arrays) || !PyTuple_Check(starts) || PyTuple_GET_SIZE(starts) != PyList_GET_SIZE(arrays))
        return PyErr_Format(PyExc_TypeError, "now(): a group is (list, tuple of starts)"), -1;
    Py_ssize_t n = PyList_GET_SIZE(arrays), k = 0, end = 0, count = PyArray_SIZE(dst);
    const char *lo = PyArray_DATA(dst), *hi = lo + PyArray_NBYTES(dst);
    if (!(*held = PyList_GetSlice(arrays, 0, n)) || !(*parts = PyMem_Malloc((n ? n : 1) * sizeof(Part)))) {
        Py_CLEAR(*held);
        return PyErr_NoMemory(), -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyList_GET_ITEM(*held, i);
        Py_ssize_t start = PyLong_AsSsize_t(PyTuple_GET_ITEM(starts, i));
        if (start == -1 && PyErr_Occurred()) {
            PyMem_Free(*parts);
            Py_CLEAR(*held);
            return -1;
        }
        if (!PyArray_CheckExact(o)) continue;
        PyArrayObject *a = (PyArrayObject *)o;
        const char *d = PyArray_DATA(a);
        Py_ssize_t size = PyArray_SIZE(a);
        if (!PyArray_IS_C_CONTIGUOUS(a) || !PyArray_EquivTypes(PyArray_DESCR(a), PyArray_DESCR(dst)) ||
            start < end || start > count || size > count - start || (d < hi && lo < d + PyArray_NBYTES(a)))
            continue;
        (*parts)[k++] = (Part){d, start, size};
        end = start + size;
    }
    return k;
}

/* now(ctx, p, sig, off, src, dst, red, scale, spin_s, decided, awake) -> (code, ring mask)
 * ring mask: bit q, the ranks to ring (Lane._ring); rank 0's bit 0: posts wait for Lane._decide.
 * src: the input (C-contiguous, dst's byte size); or None when Python packed the copy already, or
 * (arrays, starts) when that copy is a flattened group's (this rank's operand read from its parts);
 * dst: the result (writable, C-contiguous); decided: rank 0's count of decided positions;
 * awake: this rank's polling callers besides this one. */
static PyObject *lane_now(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 11 || !PyObject_TypeCheck(args[0], &CtxType))
        return PyErr_Format(PyExc_TypeError, "now() takes a Context and 10 arguments"), NULL;
    Ctx *c = (Ctx *)args[0];
    int64_t p = PyLong_AsLongLong(args[1]), sig = PyLong_AsLongLong(args[2]), off = PyLong_AsLongLong(args[3]);
    int red = (int)PyLong_AsLong(args[6]);
    double scale = PyFloat_AsDouble(args[7]), spin = PyFloat_AsDouble(args[8]);
    int64_t decided = PyLong_AsLongLong(args[9]), awake = PyLong_AsLongLong(args[10]);
    if (PyErr_Occurred()) return NULL;
    if (red < 0 || (red >> 2) > 3) return PyErr_Format(PyExc_ValueError, "bad reduction %d", red), NULL;
    Py_buffer in = {0}, res;
    if (PyObject_GetBuffer(args[5], &res, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    Py_ssize_t nbytes = res.len, item = ITEM[red >> 2], nparts = 0;
    Part *parts = NULL;
    PyObject *held = NULL;
    int group = PyTuple_Check(args[4]) && PyTuple_GET_SIZE(args[4]) == 2;
    if (group && (!PyArray_CheckExact(args[5]) || PyArray_ITEMSIZE((PyArrayObject *)args[5]) != item)) {
        PyBuffer_Release(&res);
        return PyErr_Format(PyExc_TypeError, "now(): a group's result is an array of its dtype"), NULL;
    }
    if (group && (nparts = group_parts(args[4], (PyArrayObject *)args[5], &parts, &held)) < 0) {
        PyBuffer_Release(&res);
        return NULL;
    }
    if (!group && args[4] != Py_None && PyObject_GetBuffer(args[4], &in, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&res);
        return NULL;
    }
    PyObject *r = NULL;
    if ((in.obj && in.len != nbytes) || nbytes % item || off < 0 || off + nbytes > c->data_bytes) {
        PyErr_Format(PyExc_ValueError, "bad lane post: offset %lld, %zd bytes", (long long)off, nbytes);
    } else {
        uint64_t ring = 0;
        int64_t to = p + 1;
        int code = step(c, p, 1, sig, off, in.obj ? in.buf : NULL, nbytes, res.buf, red, scale, spin, decided, awake,
                        &ring, &to, parts, nparts);
        r = Py_BuildValue("(iK)", code, (unsigned long long)ring);
    }
    if (in.obj) PyBuffer_Release(&in);
    PyBuffer_Release(&res);
    PyMem_Free(parts);
    Py_XDECREF(held);
    return r;
}
