/* sdp's compiled fast-lane step (issue 30): a synchronous allreduce of the fast lane
 * (sdp/engine/lane_now.py, Lane.allreduce_now) posted, polled for and reduced in one call; also
 * Lane.burst whole (Context.burst: an allreduce_async into the batch being gathered), a learnt
 * flattened group's sdp.grouped_allreduce whole (Context.front_group) and rank 0's decision of a
 * batch's positions (Context.decide).
 *
 * The protocol is the lane's (see lane.py's and lane_*.py's docstrings); this step runs only its common
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
 *
 * One translation unit in parts, #included here in this order (the compiler sees the whole step
 * at once and inlines across parts as it would in one file; sdp.engine.native hashes every part):
 *   lane_ring.c    the Context: one rank's view of the lane's shared memory (pinned buffers),
 *                  its geometry and state, the atomics, the data ring's allocation
 *   lane_decide.c  reading the records: the poll's look and rank 0's decisions
 *   lane_reduce.c  the reductions: reduce() per dtype and op, a flattened group's parts
 *   lane_step.c    one position posted, polled for (the spin) and reduced: step(), now()
 *   lane_learn.c   what the Context learns and runs on: attach, learn, learn_group, learn_batch
 *   lane_front.c   front() and front_group(): the common cases whole, from sdp.allreduce and
 *                  sdp.grouped_allreduce
 *   lane_batch.c   burst() and flush(): Lane.burst's and Lane.flush's common cases whole
 *   (here)         the Context type: its method table
 *   lane_layout.c  the module's functions for fusion.Layout and aligned arrays
 *   link_now.c     the host leaders' link's compiled step (LinkFront)
 *   (here)         the module table and its init
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

#include "lane_ring.c" /* (the Context) */
#include "lane_decide.c" /* (the poll's look, rank 0's decisions) */
#include "lane_reduce.c" /* (reduce()) */
#include "lane_step.c" /* (step(), now()) */
#include "lane_learn.c" /* (attach, learn) */
#include "lane_front.c" /* (front(), front_group()) */
#include "lane_batch.c" /* (burst(), flush()) */

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

#include "lane_layout.c" /* (pack, views, aligned arrays) */

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
