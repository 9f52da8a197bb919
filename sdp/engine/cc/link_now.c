/* sdp's compiled step of the host leaders' link (issue 30; sdp/engine/hostlink.py), included by
 * lane_now.c: a synchronous small allreduce across hosts whose every rank agrees (FAST) run in one
 * call on each rank, with the GIL released while it waits.  hostlink.py stays the reference: it
 * runs everything this hands back (a wait that outlasts the spin, a signature that differs on
 * some rank, a message that is not the expected one) from where this left off.
 *
 *   link_follow:  a rank other than its host's leader copies its input into its slot, writes
 *                 SIG then POST, spins (sched_yield) for the leader's RES; FAST: copies the
 *                 result out.
 *   link_lead:    the leader writes its own SIG and POST, spins for every local POST, and when
 *                 every local SIG is its own reduces its input and the local copies in rank order
 *                 (the host's partial), sends (length, MAGIC, position, signature, bytes, partial)
 *                 to every other leader over the link's TCP sockets (sdp/transport/tcp_link.py)
 *                 and reads one whole frame from each, taking only what has fully arrived
 *                 (FIONREAD), so no frame is ever left half read; when every frame is the same
 *                 position and signature, it reduces the partials in host order, scales, and
 *                 publishes the result, DECISION and RES for its host.
 * The reductions are reduce()'s: the same operations in the same order as hostlink.py's numpy
 * ufuncs (collectives.reduce_copies), so the bits are the same on every rank whichever path it took. */
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

/* codes (hostlink.py NATIVE_*) */
#define LK_DONE 1    /* FAST: the result is in out (and published, on a leader) */
#define LK_LOCAL 0   /* posted; Python waits for the local posts or the leader's decision */
#define LK_SENT (-1) /* (leader) the partial is in partial and was sent: Python gathers the rest */
#define LK_SKIP 2    /* nothing done (an input or output not aligned): Python runs it all */

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

/* link_follow(hdr_me, data_me, hdr_leader, res, k, sig, a, out, spin_s) -> LK_DONE, LK_LOCAL or LK_SKIP */
static PyObject *link_follow(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9 || !PyArray_Check(args[6]) || !PyArray_Check(args[7])) {
        PyErr_SetString(PyExc_TypeError, "link_follow(hdr_me, data_me, hdr_leader, res, k, sig, a, out, spin_s)");
        return NULL;
    }
    PyArrayObject *a = (PyArrayObject *)args[6], *out = (PyArrayObject *)args[7];
    Py_ssize_t nb = PyArray_NBYTES(a);
    int64_t *me = lk_slots(args[0], 32), *lead = lk_slots(args[2], 32);
    char *data = (char *)lk_slots(args[1], nb), *res = (char *)lk_slots(args[3], nb);
    int64_t k = PyLong_AsLongLong(args[4]), sig = PyLong_AsLongLong(args[5]);
    double spin = PyFloat_AsDouble(args[8]);
    if (PyErr_Occurred()) return NULL;
    if (!me || !lead || !data || !res || PyArray_NBYTES(out) != nb || nb > LK_MAX) {
        PyErr_SetString(PyExc_ValueError, "link_follow: slots, input or output of the wrong size");
        return NULL;
    }
    if (!PyArray_ISCARRAY_RO(a) || !PyArray_ISCARRAY(out)) return PyLong_FromLong(LK_SKIP);
    int code = LK_LOCAL;
    Py_BEGIN_ALLOW_THREADS
    memcpy(data, PyArray_DATA(a), nb);
    STORE(me[LK_SIG], sig);
    STORE(me[LK_POST], k);
    if (lk_spin_until(&lead[LK_RES], k, now_s() + spin) && LOAD(lead[LK_DECISION]) == LK_FAST) {
        memcpy(PyArray_DATA(out), res, nb);
        code = LK_DONE;
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(code);
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
 * must read it (closed, an error, a length beyond what this reads) */
static int lk_take(int fd, char *slot) {
    int avail = 0;
    uint32_t len;
    if (ioctl(fd, FIONREAD, &avail) < 0) return -1;
    if (avail < 4) return 0;
    if (recv(fd, &len, 4, MSG_PEEK | MSG_DONTWAIT) != 4) return -1;
    if (len < LK_HDR || len > LK_HDR + LK_MAX) return -1;
    if ((uint32_t)avail < 4 + len) return 0;
    return recv(fd, slot, 4 + len, MSG_DONTWAIT) == (ssize_t)(4 + len) ? 1 : -1;
}

/* link_lead(hdrs, datas, res, k, sig, a, out, partial, red, scale, out_fds, in_fds, me_host, spin_s,
 *           check_s, inbox) -> (code, [(host index, frame bytes), ...]): hdrs, datas: this host's
 * ranks' slots (this leader's first; datas[0] unused), both () alone on its host, where res is None; in_fds in host
 * order (-1 at me_host); inbox: LK_SLOT bytes per host */
static PyObject *link_lead(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 16 || !PyTuple_Check(args[0]) || !PyTuple_Check(args[1]) || !PyArray_Check(args[5]) ||
            !PyArray_Check(args[6]) || !PyTuple_Check(args[10]) || !PyTuple_Check(args[11])) {
        PyErr_SetString(PyExc_TypeError, "link_lead(hdrs, datas, res, k, sig, a, out, partial, red, scale, "
                                         "out_fds, in_fds, me_host, spin_s, check_s, inbox)");
        return NULL;
    }
    PyArrayObject *a = (PyArrayObject *)args[5], *out = (PyArrayObject *)args[6];
    Py_ssize_t nb = PyArray_NBYTES(a), nlocal = PyTuple_GET_SIZE(args[0]);
    Py_ssize_t nout = PyTuple_GET_SIZE(args[10]), nhosts = PyTuple_GET_SIZE(args[11]);
    int red = PyLong_AsLong(args[8]), me_host = PyLong_AsLong(args[12]);
    int64_t k = PyLong_AsLongLong(args[3]), sig = PyLong_AsLongLong(args[4]);
    double scale = PyFloat_AsDouble(args[9]), spin = PyFloat_AsDouble(args[13]), check = PyFloat_AsDouble(args[14]);
    char *partial = (char *)lk_slots(args[7], nb), *inbox = (char *)lk_slots(args[15], LK_SLOT * nhosts);
    char *res = args[2] == Py_None ? NULL : (char *)lk_slots(args[2], nb);
    if (PyErr_Occurred()) return NULL;
    if (nlocal > MAX_RANKS || PyTuple_GET_SIZE(args[1]) != nlocal || nhosts < 2 || nhosts > LK_HOSTS ||
            me_host < 0 || me_host >= nhosts || !partial || !inbox || (args[2] != Py_None && !res) ||
            PyArray_NBYTES(out) != nb || nb > LK_MAX || red < 0 || red > 15) {
        PyErr_SetString(PyExc_ValueError, "link_lead: arguments of the wrong size");
        return NULL;
    }
    if (!PyArray_ISCARRAY_RO(a) || !PyArray_ISCARRAY(out)) return Py_BuildValue("(i[])", LK_SKIP);
    int64_t *hdr[MAX_RANKS];
    char *data[MAX_RANKS];
    int ofd[LK_HOSTS], ifd[LK_HOSTS];
    for (Py_ssize_t q = 0; q < nlocal; q++) {
        hdr[q] = lk_slots(PyTuple_GET_ITEM(args[0], q), 32);
        data[q] = q ? (char *)lk_slots(PyTuple_GET_ITEM(args[1], q), nb) : NULL;
        if (!hdr[q] || (q && !data[q])) {
            PyErr_SetString(PyExc_ValueError, "link_lead: a local rank's slot of the wrong size");
            return NULL;
        }
    }
    for (Py_ssize_t h = 0; h < nout; h++) ofd[h] = PyLong_AsLong(PyTuple_GET_ITEM(args[10], h));
    for (Py_ssize_t h = 0; h < nhosts; h++) ifd[h] = PyLong_AsLong(PyTuple_GET_ITEM(args[11], h));
    if (PyErr_Occurred()) return NULL;
    int code = LK_LOCAL, taken[LK_HOSTS] = {0}, odd = 0;
    Py_ssize_t count = nb / ITEM[red >> 2];
    Py_BEGIN_ALLOW_THREADS
    if (nlocal) {
        STORE(hdr[0][LK_SIG], sig);
        STORE(hdr[0][LK_POST], k);
    }
    double until = now_s() + spin;
    int ready = 1, same = 1;
    for (Py_ssize_t q = 1; q < nlocal && ready; q++) ready = lk_spin_until(&hdr[q][LK_POST], k, until);
    for (Py_ssize_t q = 1; q < nlocal && ready; q++) same = same && LOAD(hdr[q][LK_SIG]) == sig;
    if (ready && same) {
        char *src[MAX_RANKS];
        src[0] = PyArray_DATA(a);
        for (Py_ssize_t q = 1; q < nlocal; q++) src[q] = data[q];
        reduce(red, src, nlocal ? (int)nlocal : 1, partial, count, 1.0);
        uint32_t len = LK_HDR + (uint32_t)nb;
        uint64_t pos = (uint64_t)k, bytes = (uint64_t)nb;
        char head[4 + LK_HDR];
        memcpy(head, &len, 4);
        memcpy(head + 4, "SDPL", 4);
        memcpy(head + 8, &pos, 8);
        memcpy(head + 16, &sig, 8);
        memcpy(head + 24, &bytes, 8);
        for (Py_ssize_t h = 0; h < nout; h++) {
            struct iovec iov[2] = {{head, sizeof head}, {partial, (size_t)nb}};
            lk_send_all(ofd[h], iov, 2);
        }
        code = LK_SENT;
        int left = (int)nhosts - 1;
        double limit = now_s() + check;
        while (left > 0 && !odd) {
            int moved = 0;
            struct pollfd pf[LK_HOSTS];
            int np = 0;
            for (Py_ssize_t h = 0; h < nhosts && !odd; h++) {
                if (h == me_host || taken[h]) continue;
                int got = lk_take(ifd[h], inbox + h * LK_SLOT);
                if (got < 0) odd = 1;
                else if (got > 0) {
                    char *f = inbox + h * LK_SLOT;
                    uint32_t flen;
                    uint64_t fpos, fbytes;
                    int64_t fsig;
                    memcpy(&flen, f, 4);
                    memcpy(&fpos, f + 8, 8);
                    memcpy(&fsig, f + 16, 8);
                    memcpy(&fbytes, f + 24, 8);
                    taken[h] = 1, left--, moved = 1;
                    if (memcmp(f + 4, "SDPL", 4) || fpos != pos || fsig != sig || fbytes != bytes || flen != len)
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
        if (left == 0 && !odd) {
            char *parts[LK_HOSTS];
            for (Py_ssize_t h = 0; h < nhosts; h++) parts[h] = h == me_host ? partial : inbox + h * LK_SLOT + 4 + LK_HDR;
            reduce(red, parts, (int)nhosts, PyArray_DATA(out), count, scale);
            if (res && nlocal) {
                memcpy(res, PyArray_DATA(out), nb);
                STORE(hdr[0][LK_DECISION], LK_FAST);
                STORE(hdr[0][LK_RES], k);
            }
            code = LK_DONE;
        }
    }
    Py_END_ALLOW_THREADS
    PyObject *frames = PyList_New(0);
    if (!frames) return NULL;
    for (Py_ssize_t h = 0; h < nhosts && code == LK_SENT; h++) {
        if (!taken[h]) continue;
        uint32_t flen;
        memcpy(&flen, inbox + h * LK_SLOT, 4);
        PyObject *item = Py_BuildValue("(ny#)", h, inbox + h * LK_SLOT + 4, (Py_ssize_t)flen);
        if (!item || PyList_Append(frames, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(frames);
            return NULL;
        }
        Py_DECREF(item);
    }
    return Py_BuildValue("(iN)", code, frames);
}
