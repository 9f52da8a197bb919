/* lane_reduce.c: part of sdp's compiled fast-lane step, #included by lane_now.c (one translation unit,
 * not compiled alone: it uses what lane_now.c and the parts included before it define).
 *
 * The reductions: reduce() -- every rank's copy, in rank order, into the result (float32,
 * float64, int32, int64; SUM, MIN, MAX, PRODUCT), then times the float scale: numpy's ufuncs'
 * operations in their order (collectives.reduce_copies), so a rank's bits are the same whichever
 * path it took; the host leaders' link (link_now.c) reduces with it too -- ITEM, the bytes of an
 * element by dtype code, and reduce_parts, a flattened group's reduction with this rank's operand
 * read from the group's own arrays.
 */

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
