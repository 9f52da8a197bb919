/* lane_front.c: part of sdp's compiled fast-lane step, #included by lane_now.c (one translation unit,
 * not compiled alone: it uses what lane_now.c and the parts included before it define).
 *
 * The front door: ctx.front (Lane.allreduce_now's common case whole, from sdp.allreduce) and
 * ctx.front_group (sdp.grouped_allreduce's): the call matched against what was learnt, the lane's
 * lock taken without blocking, the lane checked idle with room, the input's place allocated, the
 * result made (result_of, aligned_new) and the step run (run_front, run_posted: flush() runs it
 * too), the lane's Python state updated as Lane._finish_now would; anything but FAST without a
 * doorbell goes on in Lane._finish_now.  Also what the entries share to read and write the lane's
 * Python attributes (attr_is, int_attr, set_int, the interned names S_*, unlock).
 */

static int same_shape(PyArrayObject *a, Entry *e) {
    return PyArray_NDIM(a) == e->ndim && !memcmp(PyArray_DIMS(a), e->dims, e->ndim * sizeof(npy_intp));
}

/* an attribute of o as int64 (-1 and an exception when it is not an int) */
static int64_t int_attr(PyObject *o, PyObject *name) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (!v) return -1;
    int64_t x = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return x;
}

static int set_int(PyObject *o, PyObject *name, int64_t x) {
    PyObject *v = PyLong_FromLongLong(x);
    int r = v ? PyObject_SetAttr(o, name, v) : -1;
    Py_XDECREF(v);
    return r;
}

enum { IS_NONE, IS_EMPTY, IS_TRUE };

/* 1 when attribute `name` of o is None / has length 0 / is true (what), 0 when not, -1: error */
static int attr_is(PyObject *o, PyObject *name, int what) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (!v) return -1;
    Py_ssize_t r = what == IS_NONE ? v == Py_None : what == IS_TRUE ? PyObject_IsTrue(v) : PyObject_Length(v);
    Py_DECREF(v);
    return what == IS_EMPTY ? (r < 0 ? -1 : r == 0) : (int)r;
}

static PyObject *S_failed, *S_off, *S_enabled, *S_held, *S_batch, *S_deferred, *S_head, *S_heads, *S_posted,
    *S_done, *S_decided, *S_awake, *S_first_seen, *S_active_until, *S_spin_s, *S_pending, *S_queue, *S_counts,
    *S_fast, *S_dtype, *S_op, *S_postscale, *S_arrays, *S_names, *S_nbytes, *S_order, *S_handle,
    *S_head_to_learn, *S_batches, *S_done_batch, *F_inf, *F_zero, *I_one;

/* release lane.lock, keeping a pending exception: -1 when one is pending after */
static int unlock(Ctx *c) {
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyObject *r = PyObject_Vectorcall(c->release, NULL, 0, NULL);
    if (t) {
        Py_XDECREF(r);
        PyErr_Clear();
        PyErr_Restore(t, v, tb);
        return -1;
    }
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

/* a new C-contiguous array of descr (a reference stolen) and shape dims[nd] whose data starts on
 * an ALIGN boundary, in a uint8 heap array of ALIGN more bytes (its base): numpy's own are only
 * 16-byte aligned, and finding the address from Python (ndarray.ctypes) cost ~1.2 of the ~3 us
 * that fusion.aligned_empty took */
static PyObject *aligned_new(PyArray_Descr *descr, int nd, npy_intp *dims) {
    npy_intp nbytes = PyDataType_ELSIZE(descr);
    for (int k = 0; k < nd; k++) nbytes *= dims[k];
    npy_intp n = nbytes + ALIGN;
    PyObject *raw = PyArray_SimpleNew(1, &n, NPY_UINT8);
    if (!raw) {
        Py_DECREF(descr);
        return NULL;
    }
    char *at = (char *)PyArray_DATA((PyArrayObject *)raw);
    at += (-(intptr_t)at) & (ALIGN - 1);
    PyObject *r = PyArray_NewFromDescr(&PyArray_Type, descr, nd, dims, NULL, at, NPY_ARRAY_CARRAY, NULL);
    if (!r || PyArray_SetBaseObject((PyArrayObject *)r, raw) < 0) { /* (the base: a reference stolen) */
        Py_XDECREF(r);
        if (!r) Py_DECREF(raw);
        return NULL;
    }
    return r;
}

/* a new result of descr and shape dims[nd] (nbytes): 64-byte aligned, carved out of a 64 KB
 * chunk up to SMALL bytes (as fusion.aligned_empty), else aligned_new's */
static PyObject *result_of(Ctx *c, PyArray_Descr *descr, int nd, npy_intp *dims, Py_ssize_t nbytes) {
    if (nbytes > SMALL) {
        Py_INCREF(descr);
        return aligned_new(descr, nd, dims);
    }
    if (!c->chunk || c->chunk_used + nbytes > CHUNK) {
        npy_intp n = CHUNK + ALIGN;
        PyObject *chunk = PyArray_SimpleNew(1, &n, NPY_UINT8);
        if (!chunk) return NULL;
        Py_XSETREF(c->chunk, chunk);
        c->chunk_used = (-(intptr_t)PyArray_DATA((PyArrayObject *)chunk)) & (ALIGN - 1);
    }
    char *at = (char *)PyArray_DATA((PyArrayObject *)c->chunk) + c->chunk_used;
    Py_INCREF(descr);
    PyObject *r = PyArray_NewFromDescr(&PyArray_Type, descr, nd, dims, NULL, at, NPY_ARRAY_CARRAY, NULL);
    if (!r) return NULL;
    Py_INCREF(c->chunk);
    if (PyArray_SetBaseObject((PyArrayObject *)r, c->chunk) < 0) {
        Py_DECREF(r);
        return NULL;
    }
    c->chunk_used += (nbytes > 0 ? nbytes + ALIGN - 1 : ALIGN) / ALIGN * ALIGN;
    return r;
}

/* nothing held or deferred here, the lane on and not failed: 1, 0, -1 error */
static int lane_free(PyObject *L) {
    int r;
    if ((r = attr_is(L, S_failed, IS_NONE)) != 1 || (r = attr_is(L, S_off, IS_TRUE)) != 0 ||
        (r = attr_is(L, S_enabled, IS_TRUE)) != 1 || (r = attr_is(L, S_held, IS_EMPTY)) != 1 ||
        (r = attr_is(L, S_deferred, IS_EMPTY)) != 1)
        return r < 0 ? -1 : 0;
    return 1;
}

/* the lane is idle for allreduce_now (Lane._room_now's checks but the ring): 1, 0, -1 error */
static int lane_idle(Ctx *c, PyObject *name) {
    PyObject *L = c->lane;
    int r;
    if ((r = lane_free(L)) != 1 || (r = attr_is(L, S_batch, IS_NONE)) != 1 || (r = attr_is(L, S_head, IS_NONE)) != 1)
        return r < 0 ? -1 : 0;
    PyObject *heads = PyObject_GetAttr(L, S_heads);
    if (!heads) return -1;
    r = PySequence_Contains(heads, name);
    Py_DECREF(heads);
    return r < 0 ? -1 : !r;
}

/* one call of front(), front_group() or flush() once its arguments matched what was learnt */
typedef struct {
    PyObject *name;        /* the lane's name (a group's: Layout's group name) */
    int64_t sig;
    int red;
    double scale;
    Py_ssize_t nbytes;
    PyArrayObject *a;      /* front(): the input; NULL: a group */
    PyObject *out;         /* front(): out or None; a group: None */
    GEntry *g;             /* front_group(), flush(): the entry, */
    const Part *parts;     /* its arrays' data (every part, in order) */
    PyObject *args[4];     /* Lane._finish_now's (a, op, postscale, out) */
    PyObject *batch;       /* flush(): the _Batch posted (its m positions), else NULL */
    int64_t m;
    int hold;              /* front_group(): Lane._finish_now returns a held group's handle */
} Front;

/* copy a group's parts into dst (count elements of item bytes), the gaps zeroed (lane_pack's) */
static void pack_parts(char *dst, const Part *parts, Py_ssize_t n, Py_ssize_t count, Py_ssize_t item) {
    Py_ssize_t end = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (parts[i].start > end) memset(dst + end * item, 0, (parts[i].start - end) * item);
        copy_in(dst + parts[i].start * item, parts[i].data, parts[i].size * item);
        end = parts[i].start + parts[i].size;
    }
    if (count > end) memset(dst + end * item, 0, (count - end) * item);
}

static PyObject *views_of(PyArrayObject *flat, PyObject *spans);

/* lane.counts[key] += k: 0, -1 error */
static int count_add(PyObject *L, PyObject *key, Py_ssize_t k) {
    PyObject *counts = PyObject_GetAttr(L, S_counts), *n = counts ? PyDict_GetItemWithError(counts, key) : NULL;
    PyObject *dk = n ? PyLong_FromSsize_t(k) : NULL, *n1 = dk ? PyNumber_Add(n, dk) : NULL;
    int r = n1 && PyDict_SetItem(counts, key, n1) == 0 ? 0 : -1;
    Py_XDECREF(n1), Py_XDECREF(dk), Py_XDECREF(counts);
    return r;
}

/* the lock held, the lane idle, f's m positions free and off its place in the data ring: make the
 * result, copy the input in (a group, a batch: packed here) and run the step; consumed FAST
 * without a doorbell: the result (a group: its views; a batch: its views, after _Batch.done), else
 * Lane._finish_now (a batch: Lane._finish_batch); busy: the engine thread has work (no spin) */
static PyObject *run_posted(Ctx *c, Front *f, int64_t p, int64_t off, int busy, double spin) {
    PyObject *L = c->lane, *result;
    if (f->g) {
        npy_intp count = f->g->count;
        result = result_of(c, (PyArray_Descr *)f->g->descr, 1, &count, f->nbytes);
    } else {
        result = f->out != Py_None ? (Py_INCREF(f->out), f->out)
                                   : result_of(c, PyArray_DESCR(f->a), PyArray_NDIM(f->a), PyArray_DIMS(f->a),
                                               f->nbytes);
    }
    if (!result) { /* (an error: nothing posted) */
        unlock(c);
        return NULL;
    }
    if (busy) spin = 0.0;
    int64_t decided = c->rank == 0 ? int_attr(L, S_decided) : 0, awake = int_attr(L, S_awake), to = p + 1;
    uint64_t ring = 0;
    int code = 0, failed = PyErr_Occurred() || PyObject_SetAttr(L, S_active_until, F_inf) < 0 ||
                           (f->batch && PyObject_SetAttr(L, S_batch, Py_None) < 0);
    if (!failed) {
        if (f->batch) /* its parts' records: PART_SIG, the first position, the positions left (Lane._flush_batch) */
            for (int64_t k = 1; k < f->m; k++) {
                int64_t i = ((p + k) % c->depth) * c->rec_n;
                c->rec[c->rank][i] = c->part_sig, c->rec[c->rank][i + 1] = p, c->rec[c->rank][i + 2] = f->m - k;
            }
        if (f->g) /* (the GIL kept: the parts' arrays are the caller's) */
            pack_parts(c->data[c->rank] + off, f->parts, f->g->n, f->g->count, ITEM[f->red >> 2]);
        code = step(c, p, f->m, f->sig, off, f->g ? NULL : PyArray_DATA(f->a), f->nbytes,
                    PyArray_DATA((PyArrayObject *)result), f->red, f->scale, spin, decided, awake, &ring, &to,
                    f->parts, f->g ? f->g->n : 0);
        failed = PyObject_SetAttr(L, S_active_until, F_zero) < 0 || set_int(L, S_posted, p + f->m) < 0 ||
                 (c->rank == 0 && (code == R_FAST || code == R_RECORD) &&
                  (set_int(L, S_decided, to) < 0 || PyObject_SetAttr(L, S_first_seen, Py_None) < 0));
        if (!failed && code == R_FAST && !ring) { /* consumed and reduced: Lane._finish_now's FAST end */
            int64_t done = c->rank == 0 ? to : p + 1;
            if (c->rank && f->m > 1) { /* (a batch's parts, decided already: nothing to do; never OFF after FAST) */
                int64_t d = LOAD(c->page[0][c->decided]);
                if (d > p + f->m) d = p + f->m;
                if (d > done && LOAD(c->dec[(d - 1) % c->depth]) != c->off) done = d;
            }
            failed = count_add(L, S_fast, f->m) < 0 || (f->batch && count_add(L, S_batches, 1) < 0) ||
                     set_int(L, S_done, done) < 0;
            STORE(c->page[c->rank][c->done], done); /* (after the reduction read the peers' copies) */
            if (!failed && f->g) {
                PyObject *views = views_of((PyArrayObject *)result, f->g->spans);
                Py_SETREF(result, views);
            }
            if (!failed && result && f->batch) { /* (under the lock, as Lane._consume_batch) */
                PyObject *r = PyObject_CallMethodOneArg(f->batch, S_done_batch, result);
                if (!r) Py_CLEAR(result);
                Py_XDECREF(r);
            }
            if (unlock(c) < 0 || failed) Py_CLEAR(result);
            return result;
        }
    }
    if (failed) { /* (Python's state could not be read or written: nothing here is expected to fail) */
        unlock(c);
        Py_DECREF(result);
        return NULL;
    }
    PyObject *pp = PyLong_FromLongLong(p), *cc = PyLong_FromLong(code), *rr = PyLong_FromUnsignedLongLong(ring);
    PyObject *r = NULL;
    if (pp && cc && rr && f->batch) {
        PyObject *fargs[5] = {pp, cc, rr, f->batch, f->g->layout};
        r = PyObject_Vectorcall(c->finish_b, fargs, 5, NULL); /* (it releases the lock) */
    } else if (pp && cc && rr) {
        PyObject *fargs[12] = {pp, cc, rr, result, f->name, f->args[0], f->args[1], f->args[2], f->args[3],
                               f->g ? f->g->layout : NULL, Py_None, f->hold ? Py_True : Py_False};
        r = PyObject_Vectorcall(c->finish, fargs, f->g ? 12 : 9, NULL); /* (it releases the lock) */
    } else {
        unlock(c);
    }
    Py_XDECREF(pp), Py_XDECREF(cc), Py_XDECREF(rr), Py_DECREF(result);
    return r;
}

/* the lane's lock taken without blocking: 1, 0 (held elsewhere), -1 error */
static int try_lock(Ctx *c) {
    PyObject *no = Py_False, *got = PyObject_Vectorcall(c->acquire, &no, 1, NULL);
    int r = got == Py_True ? 1 : got ? 0 : -1;
    Py_XDECREF(got);
    return r;
}

/* room for positions p .. last of lane L and its state read (lock held): 1, 0, -1 error */
static int room(Ctx *c, int64_t p, int64_t last) {
    int64_t done = int_attr(c->lane, S_done);
    if (PyErr_Occurred()) return -1;
    return LOAD(c->page[0][c->decided]) - done < c->depth / 4 &&
           !(last - c->depth >= c->floor && last - c->depth >= min_done(c));
}

/* the spin a caller may poll for (lane.spin_s), and whether the engine thread has work: 0, -1 */
static int spin_of(Ctx *c, double *spin, int *busy) {
    *busy = attr_is(c->engine, S_pending, IS_EMPTY) != 1 || attr_is(c->engine, S_queue, IS_EMPTY) != 1;
    PyObject *s = PyErr_Occurred() ? NULL : PyObject_GetAttr(c->lane, S_spin_s);
    *spin = s ? PyFloat_AsDouble(s) : 0.0;
    Py_XDECREF(s);
    return PyErr_Occurred() ? -1 : 0;
}

/* the rest of front() and front_group(): take the lane's lock (else None), check the lane is
 * idle with room, and run the step (run_posted) */
static PyObject *run_front(Ctx *c, Front *f) {
    int locked = try_lock(c);
    if (locked != 1) {
        if (locked < 0) return NULL;
        Py_RETURN_NONE;
    }
    int64_t p = int_attr(c->lane, S_posted), off = -1;
    int idle = PyErr_Occurred() ? -1 : lane_idle(c, f->name), busy;
    double spin;
    if (idle == 1 && room(c, p, p) == 1 && spin_of(c, &spin, &busy) == 0) off = alloc_at(c, f->nbytes, p);
    if (off < 0) { /* not idle, no room, or an error */
        if (unlock(c) < 0 || PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    return run_posted(c, f, p, off, busy, spin);
}

/* ctx.front(name, a, op, postscale, out) -> the result, or None (nothing posted: run
 * Lane.allreduce_now, or submit) -- Lane.allreduce_now's common case whole: a learnt name,
 * dtype, shape, op and postscale (learn()); a C-contiguous numpy array; out None or a
 * C-contiguous writable numpy array of a's dtype and shape; the lane idle and its lock free.
 * Whatever is not consumed FAST without a doorbell goes on in Lane._finish_now. */
static PyObject *ctx_front(Ctx *c, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) return PyErr_Format(PyExc_TypeError, "front() takes 5 arguments"), NULL;
    PyObject *name = args[0], *a = args[1], *op = args[2], *ps = args[3], *out = args[4];
    if (!c->lane || !c->cache || !PyArray_CheckExact(a) || !PyFloat_CheckExact(ps)) Py_RETURN_NONE;
    PyObject *cap = PyDict_GetItemWithError(c->cache, name);
    if (!cap) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    Entry *e = PyCapsule_GetPointer(cap, NULL);
    PyArrayObject *arr = (PyArrayObject *)a, *o = (PyArrayObject *)out;
    if (!e || (PyObject *)PyArray_DESCR(arr) != e->descr || op != e->op || PyFloat_AS_DOUBLE(ps) != e->postscale ||
        !same_shape(arr, e) || !PyArray_IS_C_CONTIGUOUS(arr))
        Py_RETURN_NONE;
    if (out != Py_None && (!PyArray_CheckExact(out) || (PyObject *)PyArray_DESCR(o) != e->descr || !same_shape(o, e) ||
                           !PyArray_IS_C_CONTIGUOUS(o) || !PyArray_ISWRITEABLE(o)))
        Py_RETURN_NONE;
    /* (copied: the entry may be replaced once the GIL is let go, in lock.acquire) */
    Front f = {name, e->sig, e->red, e->scale, PyArray_NBYTES(arr), arr, out, NULL, NULL, {a, op, ps, out}, NULL, 1};
    return run_front(c, &f);
}

static int metas_match(PyObject *arrays, PyObject *metas, int contiguous);

/* ctx.front_group(names, arrays, op, postscale, threshold[, hold]) -> the list of results, or None
 * (nothing posted: sdp.api._grouped_submit goes on); hold true (grouped_allreduce_async): a group
 * not consumed FAST is held and its Handle returned -- sdp.grouped_allreduce's common case whole:
 * the arrays (a list) of a group learnt under names (learn_group(): the same names, fusion
 * threshold, dtypes and shapes, op and postscale), each C-contiguous, packed into the data ring
 * here; its results are views of one new array (fusion.Layout.views).  What is not consumed FAST
 * without a doorbell goes on in Lane._finish_now with the group's layout. */
static PyObject *ctx_front_group(Ctx *c, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 && nargs != 6) return PyErr_Format(PyExc_TypeError, "front_group() takes 5 or 6 arguments"), NULL;
    int hold = nargs == 6 ? PyObject_IsTrue(args[5]) : 0;
    if (hold < 0) return NULL;
    PyObject *names = args[0], *arrays = args[1], *op = args[2], *ps = args[3];
    if (!c->lane || !c->gcache || !PyList_Check(names) || !PyList_Check(arrays) || !PyFloat_CheckExact(ps) ||
        !PyLong_CheckExact(args[4]) || PyList_GET_SIZE(names) < 2 || PyList_GET_SIZE(arrays) != PyList_GET_SIZE(names))
        Py_RETURN_NONE;
    PyObject *cap = PyDict_GetItemWithError(c->gcache, PyList_GET_ITEM(names, 0));
    if (!cap) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    GEntry *g = PyCapsule_GetPointer(cap, NULL);
    Py_ssize_t n = PyList_GET_SIZE(names), threshold = PyLong_AsSsize_t(args[4]);
    if (threshold == -1 && PyErr_Occurred()) return NULL;
    if (!g || g->n != n || g->threshold != threshold || op != g->op || PyFloat_AS_DOUBLE(ps) != g->postscale)
        Py_RETURN_NONE;
    for (Py_ssize_t i = 0; i < n; i++) { /* (the same names: a peer's group is matched by its signature) */
        PyObject *x = PyList_GET_ITEM(names, i), *y = PyTuple_GET_ITEM(g->names, i);
        if (x != y && (!PyUnicode_CheckExact(x) || PyUnicode_Compare(x, y) != 0)) {
            if (PyErr_Occurred()) return NULL;
            Py_RETURN_NONE;
        }
    }
    int ok = metas_match(arrays, g->metas, 1);
    if (ok <= 0) return ok < 0 ? NULL : (Py_INCREF(Py_None), Py_None);
    /* (held: the entry, which learn_group may replace, and the arrays, which the caller's list may
     * drop, while the GIL is let go) */
    PyObject *held = PyList_GetSlice(arrays, 0, n);
    Part *parts = PyMem_Malloc(n * sizeof(Part));
    if (!held || !parts) {
        Py_XDECREF(held), PyMem_Free(parts);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++)
        parts[i] = (Part){PyArray_DATA((PyArrayObject *)PyList_GET_ITEM(held, i)), g->starts[i], g->sizes[i]};
    Py_INCREF(cap);
    Front f = {g->group, g->sig, g->red, g->scale, g->count * ITEM[g->red >> 2], NULL, Py_None, g, parts,
               {held, op, ps, Py_None}, NULL, 1, hold};
    PyObject *r = run_front(c, &f);
    Py_DECREF(cap), Py_DECREF(held), PyMem_Free(parts);
    return r;
}
