/* The floor of the host leaders' link's shape across two hosts (issue 30; benchmarks/latency.py
 * compiles it and runs it on every rank at once): a small allreduce done as sdp.engine.hostlink
 * does it, with nothing of sdp around it.
 *
 *   link_floor SHM_PATH INDEX NLOCAL NBYTES ITERS [FD]
 *
 * The NLOCAL ranks of one host share the file SHM_PATH (made by the caller, at least 8 MB).
 * INDEX 0 is the host's leader, FD its connected TCP socket to the other host's leader; per
 * iteration, as the link's FAST path does:
 *   - every other rank copies its float32 input of NBYTES into its slot, raises its post flag,
 *     then waits for the leader's result flag and copies the result out;
 *   - the leader waits for every local post, sums its input and the local copies (the host's
 *     partial), sends it to the other leader, receives the other's, sums the two into the shared
 *     result, raises the result flag and copies the result out.
 * Waits on shared memory spin yielding the core (sched_yield), as the link's do; the leader
 * waits for the other in a blocking recv.  The leader prints "SECONDS": its median seconds per
 * iteration (the first ITERS / 10 not counted).  Every wait gives up after 10 s (exit 3): a dead
 * peer never hangs it. */
#define _GNU_SOURCE
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <fcntl.h>
#include <time.h>
#include <unistd.h>

#include "floor.h"

#define MAX_LOCAL 64
#define MAX_BYTES 65536


typedef struct {
    Flag posted[MAX_LOCAL], result;
    float data[MAX_LOCAL][MAX_BYTES / 4];
    float res[MAX_BYTES / 4];
} Shared;


static void wait_at_least(Flag *f, long want) {
    double limit = now_s() + 10.0;
    for (long spins = 0; atomic_load_explicit(&f->v, memory_order_acquire) < want; spins++) {
        sched_yield();
        if ((spins & 255) == 255 && now_s() > limit) {
            fprintf(stderr, "link_floor: a local rank did not answer within 10 s\n");
            exit(3);
        }
    }
}

static void exchange(int fd, const float *mine, float *theirs, size_t nb) {
    for (size_t sent = 0; sent < nb;) {
        ssize_t k = send(fd, (const char *)mine + sent, nb - sent, 0);
        if (k <= 0) { perror("link_floor: send"); exit(3); }
        sent += (size_t)k;
    }
    for (size_t got = 0; got < nb;) {
        ssize_t k = recv(fd, (char *)theirs + got, nb - got, 0);
        if (k <= 0) { fprintf(stderr, "link_floor: the other leader did not answer\n"); exit(3); }
        got += (size_t)k;
    }
}


int main(int argc, char **argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: link_floor SHM_PATH INDEX NLOCAL NBYTES ITERS [FD]\n");
        return 2;
    }
    int me = atoi(argv[2]), nlocal = atoi(argv[3]);
    size_t nb = (size_t)atol(argv[4]), n = nb / 4;
    long iters = atol(argv[5]), warm = iters / 10;
    int fd = argc > 6 ? atoi(argv[6]) : -1;
    if (me < 0 || nlocal < 1 || nlocal > MAX_LOCAL || me >= nlocal || nb < 4 || nb % 4 || nb > MAX_BYTES
            || iters < 10 || iters > 1000000 || (me == 0) != (fd >= 0)) {
        fprintf(stderr, "link_floor: bad arguments\n");
        return 2;
    }
    int shm_fd = open(argv[1], O_RDWR);
    struct stat st;
    if (shm_fd < 0 || fstat(shm_fd, &st) || (size_t)st.st_size < sizeof(Shared)) {
        fprintf(stderr, "link_floor: %s is missing or under %zu bytes\n", argv[1], sizeof(Shared));
        return 2;
    }
    Shared *sh = mmap(NULL, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED, shm_fd, 0);
    if (sh == MAP_FAILED) return perror("mmap"), 1;
    if (fd >= 0) { /* (blocking: Python's sockets with a timeout are non-blocking underneath) */
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
        struct timeval limit = {10, 0};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof limit);
    }
    float *src = aligned_alloc(64, MAX_BYTES), *out = aligned_alloc(64, MAX_BYTES),
          *partial = aligned_alloc(64, MAX_BYTES), *theirs = aligned_alloc(64, MAX_BYTES);
    double *times = malloc(sizeof(double) * iters);
    if (!src || !out || !partial || !theirs || !times) return 1;
    for (size_t i = 0; i < n; i++) src[i] = (float)(1 + i % 7);
    for (long it = 1; it <= iters; it++) {
        double t0 = now_s();
        if (me) {
            memcpy(sh->data[me], src, nb);
            atomic_store_explicit(&sh->posted[me].v, it, memory_order_release);
            wait_at_least(&sh->result, it);
            memcpy(out, sh->res, nb);
        } else {
            for (int q = 1; q < nlocal; q++) wait_at_least(&sh->posted[q], it);
            memcpy(partial, src, nb);
            for (int q = 1; q < nlocal; q++)
                for (size_t i = 0; i < n; i++) partial[i] += sh->data[q][i];
            exchange(fd, partial, theirs, nb);
            for (size_t i = 0; i < n; i++) sh->res[i] = partial[i] + theirs[i];
            atomic_store_explicit(&sh->result.v, it, memory_order_release);
            memcpy(out, sh->res, nb);
        }
        times[it - 1] = now_s() - t0;
    }
    if (me) return 0;
    printf("%.9f\n", median_after(times, warm, iters));
    return 0;
}
