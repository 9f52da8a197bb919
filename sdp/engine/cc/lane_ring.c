/* lane_ring.c: part of sdp's compiled fast-lane step, #included by lane_now.c (one translation unit,
 * not compiled alone: it uses what lane_now.c and the parts included before it define).
 *
 * The Context (_sdp_lane.Context): one rank's view of the lane's shared memory -- every rank's
 * flag page, records and data ring, and rank 0's decisions, as writable buffers pinned while it
 * lives (the layout is lane_ring.py's) -- with its geometry and flag-page slots, the state front(),
 * burst() and flush() run on, the atomics every load and store of the protocol goes through
 * (LOAD, STORE, FENCE), and this rank's data-ring allocation (Lane._alloc, whose state the
 * context keeps: what every rank has consumed is freed).
 */

typedef struct {
    PyObject_HEAD
    int rank, size;
    int64_t depth, rec_n, data_bytes;
    int64_t posted, done, decided, awake, rung, waiting, latest, claim; /* flag-page slots */
    int64_t fast;
    volatile int64_t *page[MAX_RANKS];
    volatile int64_t *rec[MAX_RANKS];
    volatile int64_t *dec;
    char *data[MAX_RANKS];
    Py_buffer views[3 * MAX_RANKS + 1];
    int nviews;
    /* front(): the lane and engine it runs on (attach), what it learnt (learn), result chunk */
    PyObject *lane, *engine, *acquire, *release, *finish, *cache, *chunk;
    PyObject *gcache; /* front_group(): the groups learnt (learn_group), by first name */
    PyObject *bcache, *finish_b; /* flush(): the batches learnt (learn_batch), by first name; Lane._finish_batch */
    Py_ssize_t chunk_used;
    /* burst(): the PartHandle class, and lane_ring.py's _BATCH_MAX, READ_BYTES, GRACE_S (attach); the
     * batch it last added to and that batch's lists, dict, handle, dtype and op (batch_fields) */
    PyObject *part_handle, *batch, *b_arrays, *b_names, *b_order, *b_handle, *b_dtype, *b_op;
    Py_ssize_t part_slots[3]; /* PartHandle's slots name, _group, _index (offsets), or 0: call the class */
    double b_postscale, b_until; /* (b_until: the last _active_until burst() set for this batch) */
    int64_t batch_max, read_bytes;
    double grace_s;
    int64_t part_sig, slow, off; /* lane_ring.py's PART_SIG, SLOW and OFF (attach) */
    /* Lane._alloc's state: data ring bytes written and freed, (position, written) extents */
    int64_t w, tail, floor;
    int64_t *ext_p, *ext_end, ext_head, ext_len, ext_cap;
} Ctx;

#define LOAD(x) __atomic_load_n(&(x), __ATOMIC_ACQUIRE)
#define STORE(x, v) __atomic_store_n(&(x), (v), __ATOMIC_RELEASE)
#define FENCE() __atomic_thread_fence(__ATOMIC_SEQ_CST)

static int ctx_clear(Ctx *c);

static void ctx_dealloc(Ctx *c) {
    PyObject_GC_UnTrack(c);
    ctx_clear(c);
    for (int i = 0; i < c->nviews; i++) PyBuffer_Release(&c->views[i]);
    PyMem_Free(c->ext_p), PyMem_Free(c->ext_end);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

/* a writable buffer of at least `bytes` bytes, kept (pinned) while the context lives */
static void *keep(Ctx *c, PyObject *obj, Py_ssize_t bytes) {
    Py_buffer *v = &c->views[c->nviews];
    if (PyObject_GetBuffer(obj, v, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    c->nviews++;
    if (v->len < bytes) {
        PyErr_Format(PyExc_ValueError, "lane buffer of %zd bytes, %zd needed", v->len, bytes);
        return NULL;
    }
    return v->buf;
}

/* Context(rank, size, pages, recs, dec, datas, (depth, rec_n, data_bytes), slots, fast):
 * pages/recs/datas: a writable buffer per rank (rank order); slots: the flag page's
 * (POSTED, DONE, DECIDED, AWAKE, RUNG, WAITING, LATEST, CLAIM) */
static PyObject *ctx_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    int rank, size;
    PyObject *pages, *recs, *dec, *datas;
    long long depth, rec_n, data_bytes, s[8], fast;
    if (!PyArg_ParseTuple(args, "iiOOOO(LLL)(LLLLLLLL)L", &rank, &size, &pages, &recs, &dec, &datas, &depth,
                          &rec_n, &data_bytes, &s[0], &s[1], &s[2], &s[3], &s[4], &s[5], &s[6], &s[7], &fast))
        return NULL;
    if (size < 1 || size > MAX_RANKS || rank < 0 || rank >= size || depth < 1 || rec_n < 3) {
        PyErr_SetString(PyExc_ValueError, "bad lane geometry");
        return NULL;
    }
    Ctx *c = (Ctx *)type->tp_alloc(type, 0);
    if (!c) return NULL;
    c->rank = rank, c->size = size, c->depth = depth, c->rec_n = rec_n, c->data_bytes = data_bytes;
    c->posted = s[0], c->done = s[1], c->decided = s[2], c->awake = s[3];
    c->rung = s[4], c->waiting = s[5], c->latest = s[6], c->claim = s[7], c->fast = fast;
    for (int q = 0; q < size; q++) {
        PyObject *pg = PySequence_GetItem(pages, q), *rc = PySequence_GetItem(recs, q),
                 *dt = PySequence_GetItem(datas, q);
        int ok = pg && rc && dt && (c->page[q] = keep(c, pg, (s[7] + 1) * 8)) &&
                 (c->rec[q] = keep(c, rc, depth * rec_n * 8)) && (c->data[q] = keep(c, dt, data_bytes));
        Py_XDECREF(pg), Py_XDECREF(rc), Py_XDECREF(dt);
        if (!ok) {
            Py_DECREF(c);
            return NULL;
        }
    }
    if (!(c->dec = keep(c, dec, depth * 8))) {
        Py_DECREF(c);
        return NULL;
    }
    c->ext_cap = 2 * depth + 2; /* (a rank has at most depth positions unconsumed) */
    c->ext_p = PyMem_Calloc(c->ext_cap, sizeof(int64_t)), c->ext_end = PyMem_Calloc(c->ext_cap, sizeof(int64_t));
    if (!c->ext_p || !c->ext_end) {
        Py_DECREF(c);
        return PyErr_NoMemory();
    }
    return (PyObject *)c;
}

static int64_t min_done(Ctx *c) {
    int64_t m = INT64_MAX;
    for (int q = 0; q < c->size; q++) {
        int64_t v = LOAD(c->page[q][c->done]);
        if (v < m) m = v;
    }
    return c->floor = m;
}

/* Lane._alloc: the offset in this rank's data ring for nbytes of position p, or -1 (full) */
static int64_t alloc_at(Ctx *c, int64_t nbytes, int64_t p) {
    int64_t need = (nbytes + ALIGN - 1) / ALIGN * ALIGN, w = c->w, off = w % c->data_bytes;
    if (off + need > c->data_bytes) w += c->data_bytes - off, off = 0;
    if (w + need - c->tail > c->data_bytes || c->ext_len > c->depth / 4) {
        int64_t done = min_done(c); /* free the copies every rank has consumed */
        while (c->ext_len && c->ext_p[c->ext_head] < done) {
            c->tail = c->ext_end[c->ext_head];
            c->ext_head = (c->ext_head + 1) % c->ext_cap, c->ext_len--;
        }
        if (w + need - c->tail > c->data_bytes) return -1;
    }
    if (c->ext_len == c->ext_cap) return -1;
    c->w = w + need;
    int64_t at = (c->ext_head + c->ext_len++) % c->ext_cap;
    c->ext_p[at] = p, c->ext_end[at] = c->w;
    return off;
}

/* ctx.alloc(nbytes, p) -> offset or None (Lane._alloc, whose state this context keeps) */
static PyObject *ctx_alloc(Ctx *c, PyObject *args) {
    long long nbytes, p;
    if (!PyArg_ParseTuple(args, "LL", &nbytes, &p)) return NULL;
    if (nbytes < 0 || nbytes > c->data_bytes) return PyErr_Format(PyExc_ValueError, "bad size %lld", nbytes), NULL;
    int64_t off = alloc_at(c, nbytes, p);
    if (off < 0) Py_RETURN_NONE;
    return PyLong_FromLongLong(off);
}
