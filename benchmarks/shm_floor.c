/* The data floor of a shared-memory allreduce between two processes of one host (issue 30;
 * benchmarks/latency.py compiles and runs it): what moving the bytes costs with no control at all.
 *
 *   shm_floor NBYTES ITERS [NBYTES ITERS ...]
 *
 * Forks once; the two processes, pinned to the first two CPUs of their affinity where there are
 * two, each do per iteration what the fast lane's data path does (sdp/engine/cc/lane_step.c, lane_reduce.c):
 * copy a private float32 input of NBYTES into their own shared-memory buffer (as the lane copies),
 * raise a flag, wait for the peer's flag, and reduce (sum) their private input with the peer's
 * shared copy into a private result.  Buffers alternate between two, so an iteration waits only for the peer to have
 * read the buffer of two iterations before (as the lane's ring does).  Prints one line per size:
 * "NBYTES SECONDS", the larger of the two processes' median seconds per iteration (the first
 * ITERS / 10 not counted).  Every wait gives up after 10 s (exit 3): a dead peer never hangs it. */
#define _GNU_SOURCE
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "floor.h"


typedef struct {
    Flag posted[2], done[2];
    double median[2];
} Shared;


static void wait_at_least(Flag *f, long want) {
    double limit = 0;
    for (long spins = 0; atomic_load_explicit(&f->v, memory_order_acquire) < want; spins++)
        if ((spins & 1023) == 1023) {
            if (!limit) limit = now_s() + 10.0;
            else if (now_s() > limit) {
                fprintf(stderr, "shm_floor: the peer did not answer within 10 s\n");
                exit(3);
            }
        }
}

/* as the lane's copy_in: x86's "rep movsb" keeps the lines in the caches at every size, where
 * glibc's memcpy bypasses them above its non-temporal threshold (sdprun sets it to 128 KB) */
static void copy_in(void *dst, const void *src, size_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
    __asm__ volatile("rep movsb" : "+D"(dst), "+S"(src), "+c"(n) : : "memory");
#else
    memcpy(dst, src, n);
#endif
}


static void pin(int me) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) || CPU_COUNT(&set) < 2) return;
    for (int cpu = 0, seen = 0; cpu < CPU_SETSIZE; cpu++)
        if (CPU_ISSET(cpu, &set) && seen++ == me) {
            CPU_ZERO(&set);
            CPU_SET(cpu, &set);
            sched_setaffinity(0, sizeof set, &set);
            return;
        }
}

int main(int argc, char **argv) {
    if (argc < 3 || argc % 2 == 0) {
        fprintf(stderr, "usage: shm_floor NBYTES ITERS [NBYTES ITERS ...]\n");
        return 2;
    }
    size_t most = 0;
    for (int k = 1; k < argc; k += 2) {
        long nb = atol(argv[k]), iters = atol(argv[k + 1]);
        if (nb < 64 || nb % 64 || iters < 10) {
            fprintf(stderr, "shm_floor: NBYTES a positive multiple of 64, ITERS >= 10\n");
            return 2;
        }
        if ((size_t)nb > most) most = nb;
    }
    size_t head = (sizeof(Shared) + 4095) / 4096 * 4096;
    char *shm = mmap(NULL, head + 4 * most, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (shm == MAP_FAILED) return perror("mmap"), 1;
    Shared *sh = (Shared *)shm;
    pid_t child = fork();
    if (child < 0) return perror("fork"), 1;
    int me = child == 0;
    pin(me);
    float *src = aligned_alloc(64, most), *out = aligned_alloc(64, most);
    double *times = malloc(sizeof(double) * 1000000);
    if (!src || !out || !times) return 1;
    long it = 0;
    for (int k = 1; k < argc; k += 2) {
        size_t nb = atol(argv[k]), n = nb / 4;
        long iters = atol(argv[k + 1]), warm = iters / 10;
        if (iters > 1000000) iters = 1000000;
        for (size_t i = 0; i < n; i++) src[i] = (float)(me + i % 7);
        memset(out, 0, nb);
        for (long j = 0; j < iters; j++) {
            it++;
            float *mine = (float *)(shm + head + (2 * me + it % 2) * most);
            const float *peer = (const float *)(shm + head + (2 * (1 - me) + it % 2) * most);
            double t0 = now_s();
            wait_at_least(&sh->done[1 - me], it - 2); /* the peer read this buffer two iterations ago */
            copy_in(mine, src, nb);
            atomic_store_explicit(&sh->posted[me].v, it, memory_order_release);
            wait_at_least(&sh->posted[1 - me], it);
            for (size_t i = 0; i < n; i++) out[i] = src[i] + peer[i];
            atomic_store_explicit(&sh->done[me].v, it, memory_order_release);
            times[j] = now_s() - t0;
        }
        if (out[n / 2] != (float)(1 + 2 * ((n / 2) % 7))) {
            fprintf(stderr, "shm_floor: a wrong sum\n");
            return 4;
        }
        sh->median[me] = median_after(times, warm, iters);
        atomic_store_explicit(&sh->posted[me].v, ++it, memory_order_release); /* the medians are written */
        wait_at_least(&sh->posted[1 - me], it);
        if (!me) printf("%zu %.9f\n", nb, sh->median[0] > sh->median[1] ? sh->median[0] : sh->median[1]);
        atomic_store_explicit(&sh->done[me].v, it, memory_order_release);
        wait_at_least(&sh->done[1 - me], it); /* (read before the next size overwrites them) */
    }
    if (me) return 0;
    int status = 0;
    waitpid(child, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}
