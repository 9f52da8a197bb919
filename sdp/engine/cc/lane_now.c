/* sdp's compiled fast-lane step (issue 30): a synchronous allreduce of the fast lane
 * (sdp/engine/lane_now.py, Lane.allreduce_now) posted, polled for and reduced in one call; also
 * Lane.burst whole (Context.burst: an allreduce_async into the batch being gathered), a learnt
 * flattened group's sdp.grouped_allreduce whole (Context.front_group) and rank 0's decision of a
 * batch's positions (Context.decide).
 *
 * The protocol is the lane's (see lane.py's and lane_*.py's docstrings); this file runs only its common
 * case and hands everything else back to the Python code, which stays the reference:
 *   post:    copy the input into this rank's data ring at the offset Python allocated (through
 *            the caches, see copy_in), write the record (signature, offset, bytes), then LATEST
 *            and POSTED (the count last);
 *   poll:    a rank other than 0 consumes the position FAST when every rank posted it with its
 *            record and rank 0 has not claimed it, or takes rank 0's decision once published;
 *            rank 0 decides it FAST at once when every earlier position is decided and every
 *            record equals its own (else Python decides it);
 *   reduce:  every rank's copy (this rank's: its input, unless that is the result) in rank
 *            order into the result (float32/float64/int32/int64; SUM,
 *            MIN, MAX, PRODUCT), then times the float scale: the same operations, in the same
 *            order, as numpy's ufuncs in collectives.reduce_copies.
 * Stores are ordered with release/acquire atomics (plain moves on x86-64) and full fences where
 * the Python code fences (Dekker's pattern with AWAKE/RUNG/WAITING/CLAIM).  The GIL is released
 * while polling and reducing.
 *
 * Built at first use by sdp.engine.native (or `python -m sdp.engine.native`); without a C
 * compiler the lane runs in Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#if NPY_ABI_VERSION < 0x02000000 /* (numpy 1.x: the field itself) */
#define PyDataType_ELSIZE(descr) ((descr)->elsize)
#endif
#include <structmember.h> /* (T_OBJECT_EX, PyMemberDef: PartHandle's slots) */
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define MAX_RANKS 64
#define ALIGN 64             /* bytes: copies in the data ring and new results start on a cache line */
#define SMALL 4096           /* results of at most this many bytes are carved out of a chunk (fusion.SMALL_BYTES) */
#define CHUNK (64 << 10)     /* bytes of such a chunk */

/* codes returned to Python (lane_ring.py _NATIVE_*) */
#define R_FAST 1      /* consumed FAST and reduced into the result */
#define R_TIMEOUT 0   /* not consumed within the spin: Python holds the request */
#define R_PYTHON (-1) /* posted; Python polls (rings the mask first): anything but the common case */
#define R_RECORD (-2) /* consumed FAST, a peer's record is malformed: Python raises */
/* 2 (SLOW), 3 (OFF): rank 0's decision, as lane_ring.py's constants */

static PyTypeObject CtxType;

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

/* every rank posted p with signature sig */
static int equal(Ctx *c, int64_t p, int64_t sig) {
    int64_t i = (p % c->depth) * c->rec_n;
    for (int q = 0; q < c->size; q++)
        if (LOAD(c->page[q][c->posted]) <= p || LOAD(c->rec[q][i]) != sig) return 0;
    return 1;
}

static int64_t min_posted(Ctx *c) {
    int64_t m = INT64_MAX;
    for (int q = 0; q < c->size; q++) {
        int64_t v = LOAD(c->page[q][c->posted]);
        if (v < m) m = v;
    }
    return m;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* rank 0, position p decided FAST, the first of m a batch posted (Lane._flush_batch): its parts
 * p + 1 .. p + m - 1 decided SLOW when every rank posted them as a part (as Lane._decide would:
 * every rank that posted p's signature posted the same parts with it); returns the positions decided */
static int64_t decide_parts(Ctx *c, int64_t p, int64_t m) {
    if (m < 2 || min_posted(c) < p + m) return p + 1;
    for (int64_t k = p + 1; k < p + m; k++)
        for (int q = 0; q < c->size; q++)
            if (LOAD(c->rec[q][(k % c->depth) * c->rec_n]) != c->part_sig) return p + 1; /* (Python decides) */
    for (int64_t k = p + 1; k < p + m; k++) STORE(c->dec[k % c->depth], c->slow);
    return p + m;
}

/* one look: FAST (rank 0: decided and published, *to: the positions decided; *ring: ranks to
 * ring), SLOW/OFF (rank 0's decision), R_PYTHON (rank 0: Python decides), or 0 (not yet) */
static int look(Ctx *c, int64_t p, int64_t m, int64_t sig, int64_t decided, uint64_t *ring, int64_t *to) {
    volatile int64_t *first = c->page[0];
    if (c->rank) {
        if (equal(c, p, sig) && LOAD(first[c->claim]) <= p) return R_FAST;
        if (LOAD(first[c->decided]) > p) return (int)LOAD(c->dec[p % c->depth]);
        return 0;
    }
    if (decided == p && equal(c, p, sig)) { /* what Lane._decide would decide, without its work */
        STORE(c->dec[p % c->depth], c->fast);
        *to = decide_parts(c, p, m);
        STORE(first[c->decided], *to); /* last: the decisions are visible before their count */
        FENCE();
        for (int q = 1; q < c->size; q++)
            if (LOAD(c->page[q][c->waiting])) *ring |= 1ULL << q;
        return R_FAST;
    }
    if (min_posted(c) > p) return R_PYTHON; /* complete, but not the common case: Python decides */
    return 0;
}

#define REDUCE(T, EXPR)                                                   \
    do {                                                                  \
        T *o = (T *)out;                                                  \
        const T *a0 = (const T *)src[0];                                  \
        for (int q = 1; q < n; q++) {                                     \
            const T *b = (const T *)src[q];                               \
            for (Py_ssize_t k = 0; k < count; k++) {                      \
                T x = a0[k], y = b[k];                                    \
                o[k] = (EXPR);                                            \
            }                                                             \
            a0 = o;                                                       \
        }                                                                 \
        if (n == 1) memcpy(o, a0, count * sizeof(T));                     \
    } while (0)

/* red: dtype * 4 + op; dtype 0 float32, 1 float64, 2 int32, 3 int64; op 0 SUM, 1 MIN, 2 MAX, 3 PRODUCT
 * (NaN-propagating MIN/MAX as numpy's minimum/maximum; integers wrap as numpy's) */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default"))) /* (numpy's loops use AVX2 where the CPU has it) */
#endif
static int reduce(int red, char **src, int n, void *out, Py_ssize_t count, double scale) {
    int op = red & 3;
    switch (red >> 2) {
#define FLOATS(T)                                                                                  \
    switch (op) {                                                                                  \
    case 0: REDUCE(T, x + y); break;                                                               \
    case 1: REDUCE(T, (x < y || x != x) ? x : y); break;                                           \
    case 2: REDUCE(T, (x > y || x != x) ? x : y); break;                                           \
    default: REDUCE(T, x * y); break;                                                              \
    }                                                                                              \
    if (scale != 1.0) {                                                                            \
        T f = (T)scale, *o = (T *)out;                                                             \
        for (Py_ssize_t k = 0; k < count; k++) o[k] = o[k] * f;                                    \
    }
    case 0: { FLOATS(float) } break;
    case 1: { FLOATS(double) } break;
#define INTS(T, U)                                                                                 \
    switch (op) {                                                                                  \
    case 0: REDUCE(T, (T)((U)x + (U)y)); break;                                                    \
    case 1: REDUCE(T, x < y ? x : y); break;                                                       \
    case 2: REDUCE(T, x > y ? x : y); break;                                                       \
    default: REDUCE(T, (T)((U)x * (U)y)); break;                                                   \
    }
    case 2: { INTS(int32_t, uint32_t) } break;
    case 3: { INTS(int64_t, uint64_t) } break;
    default: return -1;
    }
    return 0;
}

static const Py_ssize_t ITEM[4] = {4, 8, 4, 8};

/* a flattened group's part (fusion.Layout): its input, and where it lies in the buffer (elements);
 * data NULL: reduce that span from this rank's packed copy */
typedef struct {
    const char *data;
    Py_ssize_t start, size;
} Part;

/* reduce the ranks' copies (from) into out, count elements, with this rank's operand read from the
 * group's parts where they have it (the spans between parts, padding, from its packed copy) */
static void reduce_parts(int red, char **from, int n, int me, char *out, Py_ssize_t count, double scale,
                         const Part *parts, Py_ssize_t nparts) {
    Py_ssize_t item = ITEM[red >> 2], end = 0;
    char *at[MAX_RANKS];
    for (Py_ssize_t i = 0; i <= nparts; i++) {
        Py_ssize_t start = i < nparts ? parts[i].start : count, size = i < nparts ? parts[i].size : 0;
        if (start > end) { /* a gap: every rank's packed copy */
            for (int q = 0; q < n; q++) at[q] = from[q] + end * item;
            reduce(red, at, n, out + end * item, start - end, scale);
        }
        if (size) {
            for (int q = 0; q < n; q++) at[q] = from[q] + start * item;
            if (parts[i].data) at[me] = (char *)parts[i].data;
            reduce(red, at, n, out + start * item, size, scale);
        }
        end = start + size;
    }
}

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

/* ---- the front door: Lane.allreduce_now's common case whole, from sdp.allreduce ------------- */

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

/* ctx.decide(k, complete, slow, join) -> the position from k on that rank 0 decided here: each
 * position below complete (every rank posted it) FAST when every rank's signature is the same
 * and positive, else `slow`; it stops at a `join` signature (Lane._decide's loop, for a batch) */
static PyObject *ctx_decide(Ctx *c, PyObject *args) {
    long long k, complete, slow, join;
    if (!PyArg_ParseTuple(args, "LLLL", &k, &complete, &slow, &join)) return NULL;
    for (; k < complete; k++) {
        int64_t i = (k % c->depth) * c->rec_n, sig = LOAD(c->rec[0][i]), verdict = sig > 0 ? c->fast : slow;
        for (int q = 0; q < c->size; q++) {
            int64_t other = LOAD(c->rec[q][i]);
            if (other == join) return PyLong_FromLongLong(k);
            if (other != sig) verdict = slow;
        }
        STORE(c->dec[k % c->depth], verdict);
    }
    return PyLong_FromLongLong(k);
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

static int ctx_traverse(Ctx *c, visitproc visit, void *arg) {
    Py_VISIT(c->part_handle); Py_VISIT(c->batch); Py_VISIT(c->b_arrays); Py_VISIT(c->b_names);
    Py_VISIT(c->b_order); Py_VISIT(c->b_handle); Py_VISIT(c->b_dtype); Py_VISIT(c->b_op);
    Py_VISIT(c->lane); Py_VISIT(c->engine); Py_VISIT(c->acquire); Py_VISIT(c->release); Py_VISIT(c->finish);
    Py_VISIT(c->cache); Py_VISIT(c->chunk); Py_VISIT(c->gcache); Py_VISIT(c->bcache); Py_VISIT(c->finish_b);
    return 0;
}

static int ctx_clear(Ctx *c) {
    Py_CLEAR(c->part_handle);
    forget_batch(c);
    Py_CLEAR(c->lane); Py_CLEAR(c->engine); Py_CLEAR(c->acquire); Py_CLEAR(c->release); Py_CLEAR(c->finish);
    Py_CLEAR(c->cache); Py_CLEAR(c->chunk); Py_CLEAR(c->gcache); Py_CLEAR(c->bcache); Py_CLEAR(c->finish_b);
    return 0;
}

static PyMethodDef ctx_methods[] = {
    {"front", (PyCFunction)(void (*)(void))ctx_front, METH_FASTCALL,
     "front(name, a, op, postscale, out) -> result or None (Lane.allreduce_now's common case)"},
    {"burst", (PyCFunction)(void (*)(void))ctx_burst, METH_FASTCALL,
     "burst(name, a, op, postscale) -> PartHandle or None (Lane.burst's common case)"},
    {"attach", (PyCFunction)ctx_attach, METH_VARARGS,
     "attach(lane, engine, PartHandle, batch_max, read_bytes, grace_s): the state front() and burst() run on"},
    {"learn", (PyCFunction)ctx_learn, METH_VARARGS,
     "learn(name, dtype, shape, op, postscale, sig, red, scale): what front() runs for name"},
    {"front_group", (PyCFunction)(void (*)(void))ctx_front_group, METH_FASTCALL,
     "front_group(names, arrays, op, postscale, threshold[, hold]) -> results (hold: or a Handle) or None "
     "(sdp.grouped_allreduce's common case)"},
    {"learn_group", (PyCFunction)ctx_learn_group, METH_VARARGS,
     "learn_group(names, threshold, metas, group, layout, starts, spans, count, dtype, op, postscale, sig, red, "
     "scale): what front_group() runs for names"},
    {"flush", (PyCFunction)(void (*)(void))ctx_flush, METH_FASTCALL,
     "flush(batch, spin) -> results or None (Lane.flush's common case)"},
    {"learn_batch", (PyCFunction)ctx_learn_batch, METH_VARARGS,
     "learn_batch(names, 0, metas, name, layout, starts, spans, count, dtype, op, postscale, sig, red, scale): "
     "what flush() posts for names"},
    {"batch_sig", (PyCFunction)ctx_batch_sig, METH_O,
     "batch_sig(name) -> the signature learn_batch() last learnt for name, or 0"},
    {"forget", (PyCFunction)ctx_forget, METH_NOARGS, "forget(): front() and front_group() know nothing"},
    {"decide", (PyCFunction)ctx_decide, METH_VARARGS,
     "decide(k, complete, slow, join) -> the first position not decided (Lane._decide, for a batch)"},
    {"alloc", (PyCFunction)ctx_alloc, METH_VARARGS, "alloc(nbytes, p) -> offset or None (Lane._alloc)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CtxType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_sdp_lane.Context",
    .tp_basicsize = sizeof(Ctx),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = ctx_new,
    .tp_dealloc = (destructor)ctx_dealloc,
    .tp_traverse = (traverseproc)ctx_traverse,
    .tp_clear = (inquiry)ctx_clear,
    .tp_methods = ctx_methods,
    .tp_doc = "One rank's fast-lane memory (pinned buffers) and geometry.",
};

/* ---- a flattened group's buffer (fusion.Layout): pack and views ---------------------------- */

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

#include "link_now.c" /* (the host leaders' link's compiled step: LinkFront) */

static PyMethodDef methods[] = {
    {"part_handles", (PyCFunction)(void (*)(void))lane_part_handles, METH_FASTCALL,
     "part_handles(cls, names, group) -> [cls(name, group, i) for i, name in enumerate(names)] (PartHandle)"},
    {"aligned_empty", (PyCFunction)(void (*)(void))lane_aligned_empty, METH_FASTCALL,
     "aligned_empty(dtype, count) -> a new 1-D array whose data starts on a 64-byte boundary"},
    {"exportable", (PyCFunction)lane_exportable, METH_O,
     "exportable(a) -> whether TensorFlow can wrap array a through DLPack as it is (64-byte aligned)"},
    {"same_metas", (PyCFunction)(void (*)(void))lane_same_metas, METH_FASTCALL,
     "same_metas(arrays, metas) -> whether each array has the (dtype, shape) of metas' item"},
    {"now", (PyCFunction)(void (*)(void))lane_now, METH_FASTCALL,
     "now(ctx, p, sig, off, src, dst, red, scale, spin_s, decided, awake) -> (code, ring mask)"},
    {"pack", (PyCFunction)(void (*)(void))lane_pack, METH_FASTCALL,
     "pack(arrays, out, starts) -> True, or False where Python must (fusion.Layout.pack)"},
    {"views", (PyCFunction)(void (*)(void))lane_views, METH_FASTCALL,
     "views(flat, spans) -> a view of flat per (start, end, shape or None) (fusion.Layout.views)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sdp_lane", "sdp's compiled fast-lane step.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__sdp_lane(void) {
    import_array();
#define NAME(var, text) if (!(var = PyUnicode_InternFromString(text))) return NULL
    NAME(S_failed, "failed"); NAME(S_off, "off"); NAME(S_enabled, "enabled"); NAME(S_held, "held");
    NAME(S_batch, "_batch"); NAME(S_deferred, "_deferred"); NAME(S_head, "_head"); NAME(S_heads, "_heads");
    NAME(S_head_to_learn, "_head_to_learn");
    NAME(S_posted, "_posted"); NAME(S_done, "_done"); NAME(S_decided, "_decided"); NAME(S_awake, "_awake");
    NAME(S_first_seen, "_first_seen"); NAME(S_active_until, "_active_until"); NAME(S_spin_s, "spin_s");
    NAME(S_pending, "_pending"); NAME(S_queue, "_queue"); NAME(S_counts, "counts"); NAME(S_fast, "fast");
    NAME(S_dtype, "dtype"); NAME(S_op, "op"); NAME(S_postscale, "postscale"); NAME(S_arrays, "arrays");
    NAME(S_names, "names"); NAME(S_nbytes, "nbytes"); NAME(S_order, "order");
    NAME(S_handle, "handle"); NAME(S_batches, "batches"); NAME(S_done_batch, "done");
#undef NAME
    if (!(F_inf = PyFloat_FromDouble(Py_HUGE_VAL)) || !(F_zero = PyFloat_FromDouble(0.0)) ||
        !(I_one = PyLong_FromLong(1)))
        return NULL;
    if (PyType_Ready(&CtxType) < 0 || PyType_Ready(&LinkFrontType) < 0 || link_names() < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&CtxType);
    if (PyModule_AddObject(m, "Context", (PyObject *)&CtxType) < 0) {
        Py_DECREF(&CtxType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&LinkFrontType);
    if (PyModule_AddObject(m, "LinkFront", (PyObject *)&LinkFrontType) < 0) {
        Py_DECREF(&LinkFrontType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
