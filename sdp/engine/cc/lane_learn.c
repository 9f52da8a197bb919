/* lane_learn.c: part of sdp's compiled fast-lane step, #included by lane_now.c (one translation unit,
 * not compiled alone: it uses what lane_now.c and the parts included before it define).
 *
 * What a Context learns and runs on, for front(), front_group(), burst() and flush(): attach (the
 * lane, its engine, the PartHandle class and lane_ring.py's constants), learn (an Entry: a name's
 * dtype, shape, op, postscale and signature), learn_group and learn_batch (a GEntry: a flattened
 * group's or a batch's names, layout and spans), batch_sig and forget; PartHandles made by their
 * slots (slot_offsets, part_handle_new).
 */

/* what Lane._now_entry keeps of a key, for front() (learn()) */
typedef struct {
    PyObject *descr, *op; /* strong references */
    int ndim;
    npy_intp dims[NPY_MAXDIMS];
    double postscale, scale;
    int64_t sig;
    int red;
} Entry;

static void entry_free(PyObject *cap) {
    Entry *e = PyCapsule_GetPointer(cap, NULL);
    if (e) {
        Py_XDECREF(e->descr), Py_XDECREF(e->op);
        PyMem_Free(e);
    }
}

/* offsets[3]: where instances of cls keep their slots name, _group and _index (object slots of a
 * class whose __init__ only sets them: PartHandle's), else all 0 */
static void slot_offsets(PyObject *cls, Py_ssize_t *offsets) {
    static const char *names[3] = {"name", "_group", "_index"};
    for (int i = 0; i < 3; i++) {
        PyObject *d = PyType_Check(cls) ? PyObject_GetAttrString(cls, names[i]) : NULL;
        offsets[i] = d && Py_IS_TYPE(d, &PyMemberDescr_Type) &&
                     ((PyMemberDescrObject *)d)->d_member->type == T_OBJECT_EX
                         ? ((PyMemberDescrObject *)d)->d_member->offset : 0;
        Py_XDECREF(d);
        if (!offsets[i]) {
            PyErr_Clear();
            offsets[0] = offsets[1] = offsets[2] = 0;
            return;
        }
    }
}

/* cls(name, group, index) (PartHandle) made as its __init__ would, by its slots' offsets (see
 * slot_offsets; all 0: the class called): ~0.15 us less than the call */
static PyObject *part_handle_new(PyObject *cls, const Py_ssize_t *offsets, PyObject *name, PyObject *group,
                                 PyObject *index) {
    if (!offsets[0]) {
        PyObject *hargs[3] = {name, group, index};
        return PyObject_Vectorcall(cls, hargs, 3, NULL);
    }
    PyTypeObject *type = (PyTypeObject *)cls;
    PyObject *h = type->tp_alloc(type, 0), *values[3] = {name, group, index};
    if (!h) return NULL;
    for (int i = 0; i < 3; i++) {
        Py_INCREF(values[i]);
        *(PyObject **)((char *)h + offsets[i]) = values[i];
    }
    return h;
}

/* ctx.attach(lane, engine, PartHandle, batch_max, read_bytes, grace_s, part_sig, slow, off): front(),
 * burst() and flush() read and update lane's state (see Lane.allreduce_now, Lane.burst,
 * Lane._flush_batch); engine's _pending and _queue say whether its thread has work */
static PyObject *ctx_attach(Ctx *c, PyObject *args) {
    PyObject *lane, *engine, *lock, *part_handle;
    long long batch_max, read_bytes, part_sig, slow, off;
    double grace_s;
    if (!PyArg_ParseTuple(args, "OOOLLdLLL", &lane, &engine, &part_handle, &batch_max, &read_bytes, &grace_s,
                          &part_sig, &slow, &off))
        return NULL;
    Py_INCREF(part_handle);
    Py_XSETREF(c->part_handle, part_handle);
    slot_offsets(part_handle, c->part_slots);
    c->batch_max = batch_max, c->read_bytes = read_bytes, c->grace_s = grace_s;
    c->part_sig = part_sig, c->slow = slow, c->off = off;
    if (!(lock = PyObject_GetAttrString(lane, "lock"))) return NULL;
    Py_CLEAR(c->acquire); Py_CLEAR(c->release); Py_CLEAR(c->finish); Py_CLEAR(c->finish_b);
    c->acquire = PyObject_GetAttrString(lock, "acquire");
    c->release = PyObject_GetAttrString(lock, "release");
    Py_DECREF(lock);
    c->finish = PyObject_GetAttrString(lane, "_finish_now");
    c->finish_b = PyObject_GetAttrString(lane, "_finish_batch");
    if (!c->acquire || !c->release || !c->finish || !c->finish_b) return NULL;
    Py_INCREF(lane), Py_INCREF(engine);
    Py_XSETREF(c->lane, lane);
    Py_XSETREF(c->engine, engine);
    Py_RETURN_NONE;
}

/* ctx.learn(name, dtype, shape, op, postscale, sig, red, scale): front() runs allreduces of
 * name with exactly these (the last learnt per name) */
static PyObject *ctx_learn(Ctx *c, PyObject *args) {
    PyObject *name, *descr, *shape, *op;
    double postscale, scale;
    long long sig;
    int red;
    if (!PyArg_ParseTuple(args, "OO!O!OdLid", &name, &PyArrayDescr_Type, &descr, &PyTuple_Type, &shape, &op,
                          &postscale, &sig, &red, &scale))
        return NULL;
    Py_ssize_t ndim = PyTuple_GET_SIZE(shape);
    if (ndim > NPY_MAXDIMS || red < 0 || (red >> 2) > 3) return PyErr_Format(PyExc_ValueError, "bad entry"), NULL;
    Entry *e = PyMem_Calloc(1, sizeof(Entry));
    if (!e) return PyErr_NoMemory();
    for (Py_ssize_t k = 0; k < ndim; k++) e->dims[k] = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, k));
    Py_INCREF(descr), Py_INCREF(op);
    e->descr = descr, e->op = op, e->ndim = (int)ndim, e->postscale = postscale, e->scale = scale, e->sig = sig;
    e->red = red;
    PyObject *cap = PyCapsule_New(e, NULL, entry_free);
    if (!cap) {
        Py_DECREF(descr), Py_DECREF(op), PyMem_Free(e);
        return NULL;
    }
    if (PyErr_Occurred() || (!c->cache && !(c->cache = PyDict_New())) || PyDict_SetItem(c->cache, name, cap) < 0) {
        Py_DECREF(cap);
        return NULL;
    }
    Py_DECREF(cap);
    Py_RETURN_NONE;
}

/* ctx.forget(): front() and front_group() learn again (Lane._now cleared) */
static PyObject *ctx_forget(Ctx *c, PyObject *unused) {
    if (c->cache) PyDict_Clear(c->cache);
    if (c->gcache) PyDict_Clear(c->gcache);
    Py_RETURN_NONE;
}

/* what Context.learn_group keeps of a flattened group (fusion.Layout) for front_group() */
typedef struct {
    PyObject *names, *metas, *group, *layout, *spans, *descr, *op; /* strong references */
    Py_ssize_t n, count, threshold, *starts, *sizes;
    double postscale, scale;
    int64_t sig;
    int red;
} GEntry;

static void gentry_free(PyObject *cap) {
    GEntry *g = PyCapsule_GetPointer(cap, NULL);
    if (g) {
        Py_XDECREF(g->names), Py_XDECREF(g->metas), Py_XDECREF(g->group), Py_XDECREF(g->layout);
        Py_XDECREF(g->spans), Py_XDECREF(g->descr), Py_XDECREF(g->op);
        PyMem_Free(g->starts), PyMem_Free(g->sizes);
        PyMem_Free(g);
    }
}

/* learn_group()'s and learn_batch()'s entry, kept in *cache by first name (emptied at 4096) */
static PyObject *learn_into(PyObject **cache, PyObject *args) {
    PyObject *names, *metas, *group, *layout, *starts, *spans, *descr, *op;
    Py_ssize_t threshold, count;
    double postscale, scale;
    long long sig;
    int red;
    if (!PyArg_ParseTuple(args, "O!nO!UOO!O!nO!OdLid", &PyTuple_Type, &names, &threshold, &PyList_Type, &metas,
                          &group, &layout, &PyTuple_Type, &starts, &PyList_Type, &spans, &count,
                          &PyArrayDescr_Type, &descr, &op, &postscale, &sig, &red, &scale))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(names);
    if (n < 2 || PyTuple_GET_SIZE(starts) != n || PyList_GET_SIZE(metas) != n || PyList_GET_SIZE(spans) != n ||
        red < 0 || (red >> 2) > 3 || ITEM[red >> 2] != PyDataType_ELSIZE((PyArray_Descr *)descr) || count < 0)
        return PyErr_Format(PyExc_ValueError, "bad group entry"), NULL;
    GEntry *g = PyMem_Calloc(1, sizeof(GEntry));
    if (!g) return PyErr_NoMemory();
    PyObject *cap = PyCapsule_New(g, NULL, gentry_free);
    if (!cap) {
        PyMem_Free(g);
        return NULL;
    }
    g->starts = PyMem_Malloc(n * sizeof(Py_ssize_t)), g->sizes = PyMem_Malloc(n * sizeof(Py_ssize_t));
    if (!g->starts || !g->sizes) {
        Py_DECREF(cap);
        return PyErr_NoMemory();
    }
    Py_ssize_t end = 0;
    for (Py_ssize_t i = 0; i < n; i++) { /* (the parts in order, within count: as lane_pack checks) */
        PyObject *m = PyList_GET_ITEM(metas, i), *shape = PyTuple_Check(m) && PyTuple_GET_SIZE(m) == 2
                                                             ? PyTuple_GET_ITEM(m, 1) : NULL;
        Py_ssize_t size = 1;
        if (!shape || !PyTuple_Check(shape) || !PyUnicode_Check(PyTuple_GET_ITEM(names, i))) goto bad;
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(shape); k++) size *= PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, k));
        g->starts[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(starts, i)), g->sizes[i] = size;
        if (PyErr_Occurred() || size < 0 || g->starts[i] < end || g->starts[i] > count || size > count - g->starts[i])
            goto bad;
        end = g->starts[i] + size;
    }
    g->n = n, g->count = count, g->threshold = threshold, g->postscale = postscale, g->scale = scale, g->sig = sig;
    g->red = red;
    PyObject *refs[7] = {names, metas, group, layout, spans, descr, op}, **to[7] = {&g->names, &g->metas, &g->group,
                                                                            &g->layout, &g->spans, &g->descr, &g->op};
    for (int k = 0; k < 7; k++) Py_INCREF(refs[k]), *to[k] = refs[k];
    if (*cache && PyDict_GET_SIZE(*cache) >= 4096) PyDict_Clear(*cache); /* (lane_ring.py's _SIGS_MAX) */
    if ((!*cache && !(*cache = PyDict_New())) || PyDict_SetItem(*cache, PyTuple_GET_ITEM(names, 0), cap) < 0) {
        Py_DECREF(cap);
        return NULL;
    }
    Py_DECREF(cap);
    Py_RETURN_NONE;
bad:
    Py_DECREF(cap);
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "bad group entry");
    return NULL;
}

/* ctx.learn_group(names, threshold, metas, group, layout, starts, spans, count, dtype, op, postscale,
 * sig, red, scale): front_group() runs the group of these names (a tuple), fusion threshold,
 * metas (a list of (dtype, shape) per array, sdp.api's plan key), group name, fusion.Layout and
 * its starts (a tuple), spans (a list) and count, op and postscale whole (the last learnt per
 * first name) */
static PyObject *ctx_learn_group(Ctx *c, PyObject *args) {
    return learn_into(&c->gcache, args);
}

/* ctx.learn_batch(the same, threshold 0, group the batch's name): flush() posts a batch of these
 * names, dtypes and shapes, op and postscale whole (Lane._flush_batch; the last learnt per first name) */
static PyObject *ctx_learn_batch(Ctx *c, PyObject *args) {
    return learn_into(&c->bcache, args);
}

/* ctx.batch_sig(name) -> the signature of the batch learnt for first name `name`, or 0 */
static PyObject *ctx_batch_sig(Ctx *c, PyObject *name) {
    PyObject *cap = c->bcache ? PyDict_GetItemWithError(c->bcache, name) : NULL;
    GEntry *g = cap ? PyCapsule_GetPointer(cap, NULL) : NULL;
    if (!g && PyErr_Occurred()) return NULL;
    return PyLong_FromLongLong(g ? g->sig : 0);
}
