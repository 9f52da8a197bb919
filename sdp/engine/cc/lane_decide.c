/* lane_decide.c: part of sdp's compiled fast-lane step, #included by lane_now.c (one translation unit,
 * not compiled alone: it uses what lane_now.c and the parts included before it define).
 *
 * Reading the records and deciding: whether every rank posted a position with one signature
 * (equal), the least count posted (min_posted), and the poll's look at a position -- a rank other
 * than 0 consumes it FAST or takes rank 0's published decision; rank 0 decides it FAST at once
 * when that is what Lane._decide would decide (a batch's parts with it: decide_parts), else
 * leaves it to Python; and ctx.decide, rank 0's decisions of a batch's positions
 * (Lane._decide's loop).  now_s is the spin's clock (the link's too).
 */

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
