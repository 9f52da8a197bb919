/* sdp's compiled fast-lane step (issue 30): a synchronous allreduce of the fast lane
 * (sdp/engine/lane.py, Lane.allreduce_now) posted, polled for and reduced in one call.
 *
 * The protocol is the lane's (see lane.py's module docstring); this file runs only its common
 * case and hands everything else back to the Python code, which stays the reference:
 *   post:    copy the input into this rank's data ring at the offset Python allocated, write the
 *            record (signature, offset, bytes), then LATEST and POSTED (the count last);
 *   poll:    a rank other than 0 consumes the position FAST when every rank posted it with its
 *            record and rank 0 has not claimed it, or takes rank 0's decision once published;
 *            rank 0 decides it FAST at once when every earlier position is decided and every
 *            record equals its own (else Python decides it);
 *   reduce:  every rank's copy in rank order into the result (float32/float64/int32/int64; SUM,
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
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define MAX_RANKS 64

/* codes returned to Python (lane.py NATIVE_*) */
#define R_FAST 1      /* consumed FAST and reduced into the result */
#define R_TIMEOUT 0   /* not consumed within the spin: Python holds the request */
#define R_PYTHON (-1) /* posted; Python polls (rings the mask first): anything but the common case */
#define R_RECORD (-2) /* consumed FAST, a peer's record is malformed: Python raises */
/* 2 (SLOW), 3 (OFF): rank 0's decision, as lane.py's constants */

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
} Ctx;

#define LOAD(x) __atomic_load_n(&(x), __ATOMIC_ACQUIRE)
#define STORE(x, v) __atomic_store_n(&(x), (v), __ATOMIC_RELEASE)
#define FENCE() __atomic_thread_fence(__ATOMIC_SEQ_CST)

static void ctx_dealloc(Ctx *c) {
    for (int i = 0; i < c->nviews; i++) PyBuffer_Release(&c->views[i]);
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

/* one look: FAST (rank 0: decided and published; *ring: ranks to ring), SLOW/OFF (rank 0's
 * decision), R_PYTHON (rank 0: Python decides), or 0 (not yet) */
static int look(Ctx *c, int64_t p, int64_t sig, int64_t decided, uint64_t *ring) {
    volatile int64_t *first = c->page[0];
    if (c->rank) {
        if (equal(c, p, sig) && LOAD(first[c->claim]) <= p) return R_FAST;
        if (LOAD(first[c->decided]) > p) return (int)LOAD(c->dec[p % c->depth]);
        return 0;
    }
    if (decided == p && equal(c, p, sig)) { /* what Lane._decide would decide, without its work */
        STORE(c->dec[p % c->depth], c->fast);
        STORE(first[c->decided], p + 1); /* last: the decision is visible before its count */
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

/* now(ctx, p, sig, off, src, dst, red, scale, spin_s, decided, awake) -> (code, ring mask)
 * ring mask: bit q, the ranks to ring (Lane._ring); rank 0's bit 0: posts wait for Lane._decide.
 * src: the input (C-contiguous, dst's byte size) or None when Python packed the copy already;
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
    Py_ssize_t nbytes = res.len, item = ITEM[red >> 2];
    if (args[4] != Py_None && PyObject_GetBuffer(args[4], &in, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&res);
        return NULL;
    }
    if ((in.obj && in.len != nbytes) || nbytes % item || off < 0 || off + nbytes > c->data_bytes) {
        if (in.obj) PyBuffer_Release(&in);
        PyBuffer_Release(&res);
        return PyErr_Format(PyExc_ValueError, "bad lane post: offset %lld, %zd bytes", (long long)off, nbytes), NULL;
    }
    int me = c->rank, code = 0;
    uint64_t ring = 0;
    volatile int64_t *mine = c->page[me];
    int64_t i = (p % c->depth) * c->rec_n;
    if (in.obj) memcpy(c->data[me] + off, in.buf, nbytes);
    c->rec[me][i] = sig, c->rec[me][i + 1] = off, c->rec[me][i + 2] = nbytes;
    STORE(mine[c->latest], p + 1);
    STORE(mine[c->posted], p + 1); /* last: the record is visible before its count */
    if (me != 0) { /* Lane._ring_sleepers: a rank asleep on a lane handle that may act on this post */
        FENCE();
        for (int q = 0; q < c->size; q++)
            if (q != me && LOAD(c->page[q][c->waiting]) && (q == 0 || LOAD(c->page[q][c->posted]) >= p + 1))
                ring |= 1ULL << q;
        if (ring) code = R_PYTHON;
    }
    if (!code) {
        STORE(mine[c->awake], awake + 1);
        code = look(c, p, sig, decided, &ring);
        if (!code && spin > 0) {
            Py_BEGIN_ALLOW_THREADS
            double end = now_s() + spin;
            do {
                sched_yield();
                code = look(c, p, sig, decided, &ring);
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
        char *src[MAX_RANKS];
        for (int q = 0; q < c->size; q++) {
            int64_t qoff = c->rec[q][i + 1], got = c->rec[q][i + 2];
            if (got != nbytes || qoff % item || qoff < 0 || qoff > c->data_bytes - nbytes) code = R_RECORD;
            src[q] = c->data[q] + qoff;
        }
        if (code == R_FAST) {
            Py_BEGIN_ALLOW_THREADS
            reduce(red, src, c->size, res.buf, nbytes / item, scale);
            Py_END_ALLOW_THREADS
        }
    }
    if (in.obj) PyBuffer_Release(&in);
    PyBuffer_Release(&res);
    return Py_BuildValue("(iK)", code, (unsigned long long)ring);
}

static PyTypeObject CtxType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_sdp_lane.Context",
    .tp_basicsize = sizeof(Ctx),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = ctx_new,
    .tp_dealloc = (destructor)ctx_dealloc,
    .tp_doc = "One rank's fast-lane memory (pinned buffers) and geometry.",
};

static PyMethodDef methods[] = {
    {"now", (PyCFunction)(void (*)(void))lane_now, METH_FASTCALL,
     "now(ctx, p, sig, off, src, dst, red, scale, spin_s, decided, awake) -> (code, ring mask)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sdp_lane", "sdp's compiled fast-lane step.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__sdp_lane(void) {
    if (PyType_Ready(&CtxType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&CtxType);
    if (PyModule_AddObject(m, "Context", (PyObject *)&CtxType) < 0) {
        Py_DECREF(&CtxType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
