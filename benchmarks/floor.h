/* What benchmarks/shm_floor.c and benchmarks/link_floor.c share (issue 30's floors). */
#ifndef SDP_FLOOR_H
#define SDP_FLOOR_H
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

typedef struct { /* one cache line each: no false sharing between processes' flags */
    _Atomic long v;
    char pad[64 - sizeof(long)];
} Flag;

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* the median of times[warm..iters) (sorted in place) */
static double median_after(double *times, long warm, long iters) {
    qsort(times + warm, iters - warm, sizeof(double), by_value);
    return times[warm + (iters - warm) / 2];
}
#endif
