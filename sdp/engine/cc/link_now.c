/* sdp's compiled step of the host leaders' link (issue 30; sdp/engine/hostlink.py), included by
 * lane_now.c: a synchronous small allreduce across hosts whose every rank agrees (FAST) run in one
 * call on each rank, with the GIL released while it waits.  hostlink.py stays the reference: it
 * runs everything this hands back (a wait that outlasts the spin, a signature that differs on
 * some rank, a message that is not the expected one) from where this left off.
 *
 * LinkFront (one per rank): front() runs sdp.allreduce whole for a learnt name, step() a position for
 * HostLink._native_step; as far as either goes:
 *   a follower:   a rank other than its host's leader copies its input into its slot, writes
 *                 SIG then POST, spins (sched_yield) for the leader's RES; FAST: copies the
 *                 result out.
 *   a leader:     the leader writes its own SIG and POST, spins for every local POST, and when
 *                 every local SIG is its own reduces its input and the local copies in rank order
 *                 (the host's partial), sends (length, MAGIC, position, signature, bytes, partial)
 *                 to every other leader over the link's TCP sockets (sdp/transport/tcp_link.py)
 *                 and reads one whole frame from each, taking only what has fully arrived
 *                 (FIONREAD), so no frame is ever left half read; when every frame is the same
 *                 position and signature, it reduces the partials in host order, scales, and
 *                 publishes the result, DECISION and RES for its host.
 * The reductions are reduce()'s (lane_reduce.c): the same operations in the same order as
 * hostlink.py's numpy ufuncs (collectives.reduce_copies), so the bits are the same on every rank
 * whichever path it took. */
#include <errno.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>

#define LK_POST 0 /* hostlink.py's header slots */
#define LK_SIG 1
#define LK_RES 2
#define LK_DECISION 3
#define LK_FAST 1
#define LK_HDR 28                /* hostlink._MSG.size: magic, position, signature, bytes */
#define LK_MAX (64 << 10)        /* hostlink.MAX_BYTES */
#define LK_SLOT (4 + LK_HDR + LK_MAX) /* bytes of one frame in the inbox (tcp_link's length first) */
#define LK_HOSTS 64
#define LK_KEPT (64 + LK_MAX)    /* hostlink._KEPT: a leader keeps position k's frame at slot k % 2 + 32 (resent on a
                                    repaired link connection), its partial at + 64 */

/* codes (hostlink.py NATIVE_*) */
#define LK_DONE 1    /* FAST: the result is in out (and published, on a leader) */
#define LK_LOCAL 0   /* posted; Python waits for the local posts or the leader's decision */
#define LK_SENT (-1) /* (leader) the partial is in partial and was sent: Python gathers the rest */
#define LK_SKIP 2    /* nothing done (an input or output not aligned): Python runs it all */

typedef struct {
    PyObject_HEAD
    PyObject *hl, *rt, *link, *leaders;  /* the HostLink, its runtime, (a leader) its LeaderLink; the leaders */
    PyObject *acquire, *release;         /* HostLink.lock's */
    PyObject *link_acquire, *link_release; /* (a leader) its LeaderLink's lock's */
    PyObject *cache;                     /* name -> (dtype, shape, op, postscale, signature, red, scale) */
    PyObject *keep;                      /* the arrays whose memory this reads and writes */
    int nlocal, me, me_host, nhosts;     /* this host's ranks with slots (0: alone), this rank's index */
    int64_t *hdr[MAX_RANKS];
    char *data[MAX_RANKS], *res, *partial, *inbox;
    double spin, check;
} LinkFront;

static PyObject *S_k, *S_off, *S_early, *S_fast, *S_compiled, *S_link_busy, *S_lost_at, *S_failed_rt, *S_timeline,
    *S_direct, *S_resume;

static int64_t *lk_slots(PyObject *o, Py_ssize_t need) {
    if (!PyArray_Check(o) || !PyArray_ISCARRAY((PyArrayObject *)o) || PyArray_NBYTES((PyArrayObject *)o) < need)
        return NULL;
    return (int64_t *)PyArray_DATA((PyArrayObject *)o);
}

static int lk_spin_until(volatile int64_t *word, int64_t want, double until) {
    for (int spins = 0; LOAD(*word) < want; spins++) {
        if ((spins & 15) == 15 && now_s() > until) return 0;
        sched_yield();
    }
    return 1;
}

static int lk_send_all(int fd, struct iovec *iov, int n) {
    while (n > 0) {
        struct msghdr msg = {.msg_iov = iov, .msg_iovlen = n};
        ssize_t sent = sendmsg(fd, &msg, MSG_NOSIGNAL);
        if (sent < 0) {
            if (errno == EINTR) continue;
            return -1; /* (Python's next send on it meets the error and drops the connection) */
        }
        while (n > 0 && (size_t)sent >= iov->iov_len) {
            sent -= iov->iov_len;
            iov++, n--;
        }
        if (n > 0) {
            iov->iov_base = (char *)iov->iov_base + sent;
            iov->iov_len -= sent;
        }
    }
    return 0;
}

/* the whole frame waiting on fd, if it has fully arrived, into slot: 1 taken, 0 not yet, -1 Python
 * must read it (closed, an error, a length beyond what this reads); one peek, then one read */
static int lk_take(int fd, char *slot, size_t want) {
    ssize_t got = recv(fd, slot, want, MSG_PEEK | MSG_DONTWAIT); /* (want: the frame expected, whole) */
    if (got < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? 0 : -1;
    if (got == 0) return -1; /* (closed) */
    if (got < 4) return 0;
    uint32_t len;
    memcpy(&len, slot, 4);
    if (len < LK_HDR || len > LK_HDR + LK_MAX) return -1;
    if ((size_t)got < 4 + len) return got < (ssize_t)want ? 0 : -1; /* (longer than expected: Python reads it) */
    return recv(fd, slot, 4 + len, MSG_DONTWAIT) == (ssize_t)(4 + len) ? 1 : -1;
}

/* a follower's position k: LK_DONE (the result in out) or LK_LOCAL */
static int lk_follow(LinkFront *f, int64_t k, int64_t sig, const char *a, char *out, Py_ssize_t nb) {
    int64_t *me = f->hdr[f->me], *lead = f->hdr[0];
    memcpy(f->data[f->me], a, nb);
    STORE(me[LK_SIG], sig);
    STORE(me[LK_POST], k);
    if (lk_spin_until(&lead[LK_RES], k, now_s() + f->spin) && LOAD(lead[LK_DECISION]) == LK_FAST) {
        memcpy(out, f->res, nb);
        return LK_DONE;
    }
    return LK_LOCAL;
}

/* a leader's position k: LK_DONE, LK_LOCAL or LK_SENT (taken[h]: host h's frame is in the inbox) */
static int lk_lead(LinkFront *f, int64_t k, int64_t sig, const char *a, char *out, Py_ssize_t nb, int red, double scale,
                   const int *ofd, int nout, const int *ifd, int *taken) {
    int64_t **hdr = f->hdr;
    Py_ssize_t nlocal = f->nlocal, nhosts = f->nhosts, count = nb / ITEM[red >> 2];
    int me_host = f->me_host, odd = 0;
    if (nlocal) {
        STORE(hdr[0][LK_SIG], sig);
        STORE(hdr[0][LK_POST], k);
    }
    double until = now_s() + f->spin;
    int ready = 1, same = 1;
    for (Py_ssize_t q = 1; q < nlocal && ready; q++) ready = lk_spin_until(&hdr[q][LK_POST], k, until);
    for (Py_ssize_t q = 1; q < nlocal && ready; q++) same = same && LOAD(hdr[q][LK_SIG]) == sig;
    if (!ready || !same) return LK_LOCAL;
    char *src[MAX_RANKS];
    src[0] = (char *)a;
    for (Py_ssize_t q = 1; q < nlocal; q++) src[q] = f->data[q];
    char *head = f->partial + (k & 1) * LK_KEPT + 32, *partial = head + 4 + LK_HDR;
    reduce(red, src, nlocal ? (int)nlocal : 1, partial, count, 1.0);
    uint32_t len = LK_HDR + (uint32_t)nb;
    uint64_t pos = (uint64_t)k, bytes = (uint64_t)nb;
    memcpy(head, &len, 4);
    memcpy(head + 4, "SDPL", 4);
    memcpy(head + 8, &pos, 8);
    memcpy(head + 16, &sig, 8);
    memcpy(head + 24, &bytes, 8);
    for (int h = 0; h < nout; h++) {
        struct iovec iov[1] = {{head, 4 + len}};
        lk_send_all(ofd[h], iov, 1);
    }
    int left = (int)nhosts - 1;
    double limit = now_s() + f->check;
    while (left > 0 && !odd) {
        int moved = 0, np = 0;
        struct pollfd pf[LK_HOSTS];
        for (Py_ssize_t h = 0; h < nhosts && !odd; h++) {
            if (h == me_host || taken[h]) continue;
            char *fr = f->inbox + h * LK_SLOT;
            int got = lk_take(ifd[h], fr, 4 + LK_HDR + nb);
            if (got < 0) odd = 1;
            else if (got > 0) {
                uint32_t flen;
                uint64_t fpos, fbytes;
                int64_t fsig;
                memcpy(&flen, fr, 4);
                memcpy(&fpos, fr + 8, 8);
                memcpy(&fsig, fr + 16, 8);
                memcpy(&fbytes, fr + 24, 8);
                taken[h] = 1, left--, moved = 1;
                if (memcmp(fr + 4, "SDPL", 4) || fpos != pos || fsig != sig || fbytes != bytes || flen != len)
                    odd = 1; /* (Python decides: another signature, a join, or a malformed message) */
            } else {
                pf[np].fd = ifd[h];
                pf[np].events = POLLIN;
                np++;
            }
        }
        if (odd || left == 0 || moved) continue;
        double now = now_s();
        if (now >= limit) break;
        double wait = limit - now;
        struct timespec ts = {(time_t)wait, (long)((wait - (time_t)wait) * 1e9)};
        if (ppoll(pf, np, &ts, NULL) > 0)
            for (int i = 0; i < np; i++)
                if (pf[i].revents & (POLLHUP | POLLERR | POLLNVAL)) odd = 1;
    }
    if (left || odd) return LK_SENT;
    char *parts[LK_HOSTS];
    for (Py_ssize_t h = 0; h < nhosts; h++) parts[h] = h == me_host ? partial : f->inbox + h * LK_SLOT + 4 + LK_HDR;
    reduce(red, parts, (int)nhosts, out, count, scale);
    if (nlocal) {
        memcpy(f->res, out, nb);
        STORE(hdr[0][LK_DECISION], LK_FAST);
        STORE(hdr[0][LK_RES], k);
    }
    return LK_DONE;
}

/* the frames a leader took, for Python: [(host index, frame bytes), ...] */
static PyObject *lk_frames(LinkFront *f, const int *taken) {
    PyObject *frames = PyList_New(0);
    for (int h = 0; frames && h < f->nhosts; h++) {
        if (!taken[h]) continue;
        uint32_t flen;
        memcpy(&flen, f->inbox + h * LK_SLOT, 4);
        PyObject *item = Py_BuildValue("(iy#)", h, f->inbox + h * LK_SLOT + 4, (Py_ssize_t)flen);
        if (!item || PyList_Append(frames, item) < 0) Py_CLEAR(frames);
        Py_XDECREF(item);
    }
    return frames;
}

/* fds of link.hold()'s answer (out fds, in fds) into ofd/ifd: their counts, or -1 */
static int lk_fds(LinkFront *f, PyObject *fds, int *ofd, int *nout, int *ifd) {
    PyObject *o, *i;
    if (!PyTuple_Check(fds) || PyTuple_GET_SIZE(fds) != 2 || !PyTuple_Check(o = PyTuple_GET_ITEM(fds, 0)) ||
            !PyTuple_Check(i = PyTuple_GET_ITEM(fds, 1)) || PyTuple_GET_SIZE(i) != f->nhosts ||
            PyTuple_GET_SIZE(o) >= LK_HOSTS)
        return -1;
    *nout = (int)PyTuple_GET_SIZE(o);
    for (int h = 0; h < *nout; h++) ofd[h] = PyLong_AsLong(PyTuple_GET_ITEM(o, h));
    for (int h = 0; h < f->nhosts; h++) ifd[h] = PyLong_AsLong(PyTuple_GET_ITEM(i, h));
    return PyErr_Occurred() ? -1 : 0;
}

/* step(k, sig, a, out, red, scale, fds) -> (code, frames): position k as far as the compiled step
 * goes (fds: link.hold()'s answer on a leader, None on a follower); LK_SKIP where a or out is not
 * aligned (nothing done) */
static PyObject *lf_step(LinkFront *f, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7 || !PyArray_Check(args[2]) || !PyArray_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "step(k, sig, a, out, red, scale, fds)");
        return NULL;
    }
    PyArrayObject *a = (PyArrayObject *)args[2], *out = (PyArrayObject *)args[3];
    int64_t k = PyLong_AsLongLong(args[0]), sig = PyLong_AsLongLong(args[1]);
    int red = PyLong_AsLong(args[4]), ofd[LK_HOSTS], ifd[LK_HOSTS], nout = 0, taken[LK_HOSTS] = {0}, code;
    double scale = PyFloat_AsDouble(args[5]);
    Py_ssize_t nb = PyArray_NBYTES(a);
    if (PyErr_Occurred()) return NULL;
    if (PyArray_NBYTES(out) != nb || nb > LK_MAX || red < 0 || red > 15 || nb % ITEM[red >> 2] ||
            (f->me == 0 && lk_fds(f, args[6], ofd, &nout, ifd) < 0)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "step: arguments of the wrong size");
        return NULL;
    }
    if (!PyArray_ISCARRAY_RO(a) || !PyArray_ISCARRAY(out)) return Py_BuildValue("(i[])", LK_SKIP);
    Py_BEGIN_ALLOW_THREADS
    code = f->me ? lk_follow(f, k, sig, PyArray_DATA(a), PyArray_DATA(out), nb)
                 : lk_lead(f, k, sig, PyArray_DATA(a), PyArray_DATA(out), nb, red, scale, ofd, nout, ifd, taken);
    Py_END_ALLOW_THREADS
    return code == LK_SENT ? Py_BuildValue("(iN)", code, lk_frames(f, taken)) : Py_BuildValue("(i[])", code);
}

/* learn(name, dtype, shape, op, postscale, sig, red, scale): what front() runs for name */
static PyObject *lf_learn(LinkFront *f, PyObject *args) {
    PyObject *name, *dtype, *shape, *op, *entry;
    double postscale, scale;
    long long sig;
    int red;
    if (!PyArg_ParseTuple(args, "UO!O!OdLid", &name, &PyArrayDescr_Type, &dtype, &PyTuple_Type, &shape, &op,
                          &postscale, &sig, &red, &scale))
        return NULL;
    if (PyDict_GET_SIZE(f->cache) >= 4096) PyDict_Clear(f->cache);
    if (!(entry = Py_BuildValue("(OOOdLid)", dtype, shape, op, postscale, sig, red, scale))) return NULL;
    int bad = PyDict_SetItem(f->cache, name, entry);
    Py_DECREF(entry);
    if (bad) return NULL;
    Py_RETURN_NONE;
}

static int lk_attr_true(PyObject *o, PyObject *name) { /* 1, 0, or -1 (an error) */
    PyObject *v = PyObject_GetAttr(o, name);
    if (!v) return -1;
    int t = PyObject_IsTrue(v);
    Py_DECREF(v);
    return t;
}

static int lk_add(PyObject *o, PyObject *name, long long by) {
    PyObject *v = PyObject_GetAttr(o, name), *w = NULL;
    if (v) {
        long long x = PyLong_AsLongLong(v);
        if (!PyErr_Occurred()) w = PyLong_FromLongLong(x + by);
    }
    int bad = !w || PyObject_SetAttr(o, name, w) < 0;
    Py_XDECREF(v), Py_XDECREF(w);
    return bad ? -1 : 0;
}

/* front(name, a, op, postscale, out) -> the result, or None (nothing done: Python runs the call):
 * HostLink.allreduce_now whole for a name learnt with the same dtype, shape, op and postscale; a
 * position it does not finish FAST goes on in HostLink._resume (which returns the result) */
static PyObject *lf_front(LinkFront *f, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "front(name, a, op, postscale, out)");
        return NULL;
    }
    PyObject *name = args[0], *oa = args[1], *op = args[2], *ps = args[3], *oo = args[4], *entry;
    if (!PyArray_CheckExact(oa) || !PyFloat_CheckExact(ps) || !(entry = PyDict_GetItemWithError(f->cache, name)))
        Py_RETURN_NONE; /* (an error from the lookup: a name that is not a str is not learnt either) */
    PyErr_Clear();
    PyArrayObject *a = (PyArrayObject *)oa, *out = NULL;
    PyArray_Descr *descr = (PyArray_Descr *)PyTuple_GET_ITEM(entry, 0);
    PyObject *shape = PyTuple_GET_ITEM(entry, 1);
    int nd = PyArray_NDIM(a);
    int64_t sig = PyLong_AsLongLong(PyTuple_GET_ITEM(entry, 4));
    int red = PyLong_AsLong(PyTuple_GET_ITEM(entry, 5));
    double scale = PyFloat_AsDouble(PyTuple_GET_ITEM(entry, 6));
    if (PyTuple_GET_ITEM(entry, 2) != op || PyFloat_AS_DOUBLE(ps) != PyFloat_AsDouble(PyTuple_GET_ITEM(entry, 3)) ||
            !PyArray_EquivTypes(PyArray_DESCR(a), descr) || PyTuple_GET_SIZE(shape) != nd || !PyArray_ISCARRAY_RO(a))
        Py_RETURN_NONE;
    for (int d = 0; d < nd; d++)
        if (PyArray_DIM(a, d) != PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, d))) Py_RETURN_NONE;
    Py_ssize_t nb = PyArray_NBYTES(a);
    if (oo != Py_None) {
        if (!PyArray_CheckExact(oo)) Py_RETURN_NONE;
        out = (PyArrayObject *)oo;
        char *ad = PyArray_DATA(a), *od = PyArray_DATA(out);
        if (!PyArray_EquivTypes(PyArray_DESCR(out), descr) || PyArray_NDIM(out) != nd || !PyArray_ISCARRAY(out) ||
                memcmp(PyArray_DIMS(out), PyArray_DIMS(a), nd * sizeof(npy_intp)) ||
                (f->nlocal == 0 && od < ad + nb && ad < od + nb)) /* (alone: the input is the partial, kept whole) */
            Py_RETURN_NONE;
    }
    PyObject *got = PyObject_CallOneArg(f->acquire, Py_False);
    if (!got) return NULL;
    int locked = got == Py_True;
    Py_DECREF(got);
    if (!locked) Py_RETURN_NONE; /* (another thread in the link: Python waits for it) */
    int off = lk_attr_true(f->hl, S_off), early = lk_attr_true(f->hl, S_early), failed = -1, timeline = -1;
    PyObject *v = PyObject_GetAttr(f->rt, S_failed_rt);
    if (v) failed = v != Py_None, Py_DECREF(v);
    if ((v = PyObject_GetAttr(f->rt, S_timeline))) timeline = v != Py_None, Py_DECREF(v);
    if (off || early || failed || timeline) { /* (off, frames come ahead, failed, a timeline: Python) */
        PyObject *t, *e, *tb, *r;
        PyErr_Fetch(&t, &e, &tb);
        r = PyObject_CallNoArgs(f->release);
        Py_XDECREF(r);
        PyErr_Restore(t, e, tb);
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    Py_INCREF(descr); /* (entry is the cache's: Python code below may drop it) */
    PyObject *link = NULL, *fds = NULL, *result = NULL, *kobj = NULL;
    int ofd[LK_HOSTS], ifd[LK_HOSTS], nout = 0, taken[LK_HOSTS] = {0}, code = -2;
    if (f->me == 0) { /* (LeaderLink.hold, without its Python) */
        PyObject *r = PyObject_CallNoArgs(f->link_acquire);
        if (!r) goto fail;
        Py_DECREF(r);
        link = f->link;
        Py_INCREF(link);
        if (!(fds = PyObject_GetAttr(link, S_direct)) || fds == Py_None) goto fail_held;
        if (lk_fds(f, fds, ofd, &nout, ifd) < 0) goto fail_held;
    }
    if (out) {
        result = (PyObject *)out;
        Py_INCREF(result);
    } else {
        Py_INCREF(descr);
        if (!(result = aligned_new(descr, nd, PyArray_DIMS(a)))) goto fail_held;
    }
    if (lk_add(f->hl, S_k, 1) < 0 || !(kobj = PyObject_GetAttr(f->hl, S_k)) ||
            PyObject_SetAttr(f->rt, S_link_busy, Py_True) < 0 || PyObject_SetAttr(f->hl, S_lost_at, Py_None) < 0)
        goto fail_held; /* (k counted: Python cannot go on with this position either) */
    int64_t k = PyLong_AsLongLong(kobj);
    const char *src = PyArray_DATA(a);
    char *dst = PyArray_DATA((PyArrayObject *)result);
    Py_BEGIN_ALLOW_THREADS
    code = f->me ? lk_follow(f, k, sig, src, dst, nb)
                 : lk_lead(f, k, sig, src, dst, nb, red, scale, ofd, nout, ifd, taken);
    Py_END_ALLOW_THREADS
    if (link) {
        PyObject *r = PyObject_CallNoArgs(f->link_release);
        Py_XDECREF(r);
        Py_CLEAR(link);
        Py_CLEAR(fds);
        if (!r) goto fail;
    }
    if (code == LK_DONE) {
        if (lk_add(f->hl, S_fast, 1) < 0 || lk_add(f->hl, S_compiled, 1) < 0 ||
                PyObject_SetAttr(f->rt, S_link_busy, Py_False) < 0)
            goto fail;
        Py_DECREF(kobj), Py_DECREF(descr);
        PyObject *r = PyObject_CallNoArgs(f->release);
        if (!r) {
            Py_DECREF(result);
            return NULL;
        }
        Py_DECREF(r);
        return result;
    }
    { /* the rest in Python, which lets go of the lock */
        PyObject *frames = lk_frames(f, taken), *cobj = PyLong_FromLong(code), *sobj = PyLong_FromLongLong(sig);
        PyObject *r = NULL;
        Py_DECREF(descr);
        if (frames && cobj && sobj)
            r = PyObject_CallMethodObjArgs(f->hl, S_resume, kobj, sobj, oa, result, cobj, frames, name, op, ps, oo,
                                           NULL);
        else { /* (no memory: the lock let go here) */
            PyObject *t, *v, *tb, *rr;
            PyErr_Fetch(&t, &v, &tb);
            rr = PyObject_CallNoArgs(f->release);
            Py_XDECREF(rr);
            PyErr_Restore(t, v, tb);
        }
        Py_XDECREF(frames), Py_XDECREF(cobj), Py_XDECREF(sobj), Py_DECREF(kobj), Py_DECREF(result);
        return r;
    }
fail_held:
    if (link) { /* (let go of the LeaderLink's lock, keeping any error) */
        PyObject *t, *v, *tb, *r;
        PyErr_Fetch(&t, &v, &tb);
        r = PyObject_CallNoArgs(f->link_release);
        Py_XDECREF(r);
        PyErr_Restore(t, v, tb);
    }
fail:
    Py_XDECREF(link), Py_XDECREF(fds), Py_XDECREF(result), Py_XDECREF(kobj), Py_DECREF(descr);
    {
        PyObject *t, *v, *tb, *r;
        PyErr_Fetch(&t, &v, &tb);
        r = PyObject_CallNoArgs(f->release);
        Py_XDECREF(r);
        PyErr_Restore(t, v, tb);
    }
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

static PyObject *lf_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    PyObject *hl, *rt, *link, *leaders, *hdrs, *datas, *res, *partial, *inbox, *lock;
    int me, me_host;
    double spin, check;
    if (!PyArg_ParseTuple(args, "OOOO!O!O!OOOiidd", &hl, &rt, &link, &PyList_Type, &leaders, &PyTuple_Type, &hdrs,
                          &PyTuple_Type, &datas, &res, &partial, &inbox, &me, &me_host, &spin, &check))
        return NULL;
    Py_ssize_t nlocal = PyTuple_GET_SIZE(hdrs), nhosts = PyList_GET_SIZE(leaders);
    if (nlocal > MAX_RANKS || PyTuple_GET_SIZE(datas) != nlocal || nhosts < 2 || nhosts > LK_HOSTS || me < 0 ||
            (nlocal ? me >= nlocal : me != 0) || me_host < 0 || me_host >= nhosts) {
        PyErr_SetString(PyExc_ValueError, "LinkFront: bad geometry");
        return NULL;
    }
    LinkFront *f = (LinkFront *)type->tp_alloc(type, 0);
    if (!f) return NULL;
    f->nlocal = (int)nlocal, f->me = me, f->me_host = me_host, f->nhosts = (int)nhosts;
    f->spin = spin, f->check = check;
    Py_INCREF(hl), Py_INCREF(rt), Py_INCREF(link), Py_INCREF(leaders);
    f->hl = hl, f->rt = rt, f->link = link, f->leaders = leaders;
    if (!(f->cache = PyDict_New()) || !(f->keep = Py_BuildValue("(OOOOO)", hdrs, datas, res, partial, inbox)) ||
            !(lock = PyObject_GetAttrString(hl, "lock")))
        goto bad;
    f->acquire = PyObject_GetAttrString(lock, "acquire");
    f->release = PyObject_GetAttrString(lock, "release");
    Py_DECREF(lock);
    if (!f->acquire || !f->release) goto bad;
    if (me == 0) {
        if (link == Py_None || !(lock = PyObject_GetAttrString(link, "_lock"))) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "LinkFront: a leader without its LeaderLink");
            goto bad;
        }
        f->link_acquire = PyObject_GetAttrString(lock, "acquire");
        f->link_release = PyObject_GetAttrString(lock, "release");
        Py_DECREF(lock);
        if (!f->link_acquire || !f->link_release) goto bad;
    }
    for (Py_ssize_t q = 0; q < nlocal; q++) {
        f->hdr[q] = lk_slots(PyTuple_GET_ITEM(hdrs, q), 32);
        f->data[q] = (char *)lk_slots(PyTuple_GET_ITEM(datas, q), LK_MAX);
        if (!f->hdr[q] || !f->data[q]) goto geometry;
    }
    f->res = res == Py_None ? NULL : (char *)lk_slots(res, LK_MAX);
    f->partial = partial == Py_None ? NULL : (char *)lk_slots(partial, 2 * LK_KEPT);
    f->inbox = inbox == Py_None ? NULL : (char *)lk_slots(inbox, LK_SLOT * nhosts);
    if ((nlocal && !f->res) || (me == 0 && (!f->partial || !f->inbox))) goto geometry;
    return (PyObject *)f;
geometry:
    PyErr_SetString(PyExc_ValueError, "LinkFront: a slot or buffer of the wrong size");
bad:
    Py_DECREF(f);
    return NULL;
}

static int lf_traverse(LinkFront *f, visitproc visit, void *arg) {
    Py_VISIT(f->hl);
    Py_VISIT(f->rt);
    Py_VISIT(f->link);
    Py_VISIT(f->link_acquire);
    Py_VISIT(f->link_release);
    Py_VISIT(f->leaders);
    Py_VISIT(f->acquire);
    Py_VISIT(f->release);
    Py_VISIT(f->cache);
    Py_VISIT(f->keep);
    return 0;
}

static int lf_clear(LinkFront *f) {
    Py_CLEAR(f->hl);
    Py_CLEAR(f->rt);
    Py_CLEAR(f->link);
    Py_CLEAR(f->link_acquire);
    Py_CLEAR(f->link_release);
    Py_CLEAR(f->leaders);
    Py_CLEAR(f->acquire);
    Py_CLEAR(f->release);
    Py_CLEAR(f->cache);
    Py_CLEAR(f->keep);
    return 0;
}

static void lf_dealloc(LinkFront *f) {
    PyObject_GC_UnTrack(f);
    lf_clear(f);
    Py_TYPE(f)->tp_free((PyObject *)f);
}

static PyMethodDef lf_methods[] = {
    {"front", (PyCFunction)(void (*)(void))lf_front, METH_FASTCALL,
     "front(name, a, op, postscale, out) -> result or None (HostLink.allreduce_now's common case)"},
    {"step", (PyCFunction)(void (*)(void))lf_step, METH_FASTCALL,
     "step(k, sig, a, out, red, scale, fds) -> (code, frames) (HostLink._native_step)"},
    {"learn", (PyCFunction)lf_learn, METH_VARARGS,
     "learn(name, dtype, shape, op, postscale, sig, red, scale): what front() runs for name"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LinkFrontType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_sdp_lane.LinkFront",
    .tp_basicsize = sizeof(LinkFront),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = lf_new,
    .tp_dealloc = (destructor)lf_dealloc,
    .tp_traverse = (traverseproc)lf_traverse,
    .tp_clear = (inquiry)lf_clear,
    .tp_methods = lf_methods,
    .tp_doc = "LinkFront(hostlink, runtime, leader's LeaderLink or None, leaders, hdrs, datas, res, partial, inbox, "
              "me, me_host, spin_s, check_s): one rank's compiled step of the host leaders' link "
              "(sdp.engine.hostlink).",
};

static int link_names(void) {
#define LNAME(var, text) if (!(var = PyUnicode_InternFromString(text))) return -1
    LNAME(S_k, "k"); LNAME(S_off, "off"); LNAME(S_early, "_early"); LNAME(S_fast, "fast");
    LNAME(S_compiled, "compiled"); LNAME(S_link_busy, "link_busy"); LNAME(S_lost_at, "_lost_at");
    LNAME(S_failed_rt, "_failed"); LNAME(S_timeline, "timeline"); LNAME(S_direct, "direct");
    LNAME(S_resume, "_resume");
#undef LNAME
    return 0;
}
