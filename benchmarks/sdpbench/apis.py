"""``benchmarks/allreduce.py --api``: the same allreduce through the engine (``sdp.allreduce``),
``sdp.tensorflow.allreduce`` eagerly and inside a ``tf.function``, and the floor of a graph op of
sdp's design, side by side per size, with the TF face's targets and issue 30's (in round trips)."""
import os
import statistics

import numpy as np

import latency  # (benchmarks/latency.py: benchmarks/ is on sys.path wherever sdpbench is)
import sdp
from sdpbench.common import busbw_factor, fmt_size, max_over_ranks, time_calls

API_CHOICES = ("numpy", "tf-eager", "tf-function")
TARGET_TF_1K_US = 500.0       # TF face, 1 KB allreduce, eager and in a tf.function (issue 19, item 5)
TARGET_TF_VS_ENGINE = 0.9     # TF face busbw / engine (numpy) busbw at 1 MB and 64 MB


def api_caller(api: str, buf: np.ndarray, name: str):
    """A no-argument callable doing one SUM allreduce of ``buf`` through ``api``: ``numpy``
    (``sdp.allreduce`` into a preallocated output), ``tf-eager`` (``sdp.tensorflow.allreduce``
    called eagerly), ``tf-function`` (the same inside a ``tf.function``) or ``floor`` (a
    ``tf.function`` whose one ``numpy_function`` calls ``sdp.allreduce``: no sdp.tensorflow code,
    the least a graph op of sdp's design can cost)."""
    if api == "numpy":
        out = np.empty_like(buf)
        return lambda: sdp.allreduce(buf, name=name, op=sdp.Sum, out=out)
    import tensorflow as tf

    import sdp.tensorflow as hvd
    x = tf.constant(buf)
    if api == "tf-eager":
        return lambda: hvd.allreduce(x, op=hvd.Sum, name=name)
    if api == "tf-function":
        fn = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum, name=name))
    else:  # the floor of a graph op of this design: the engine called from the one numpy_function
        fn = tf.function(lambda t: tf.numpy_function(lambda a: sdp.allreduce(a, name=name, op=sdp.Sum),
                                                     [t], t.dtype, stateful=True))
    return lambda: fn(x)

def compare_apis(args, apis, sizes, dtype) -> int:
    """``--api``: the same allreduce through each API, interleaved per size, printed side by side
    (median over iterations, max over ranks) with the TF face's targets."""
    n = sdp.size()
    med = {}
    rtt = None
    if 1024 in sizes and {"tf-eager", "tf-function"} & set(apis):  # (issue 30's targets are in round trips)
        sdp.barrier()
        rtt = max_over_ranks(latency.pipe_rtt() if sdp.rank() == 0 else 0.0, "api.rtt")
    for nbytes in sizes:
        buf = np.ones(nbytes // dtype.itemsize, dtype)
        for api in apis + (["floor"] if "tf-function" in apis else []):
            warmup = max(args.warmup, 20) if nbytes <= 4096 else args.warmup
            iters = args.iters or (max(200, args.latency_iters) if nbytes <= 4096 else 0)
            times = time_calls(api_caller(api, buf, f"api.{api}.{nbytes}"), iters, warmup, args.target_s,
                               f"api.{api}.{nbytes}")
            med[api, nbytes] = (max_over_ranks(statistics.median(times), f"api.{api}.med"), len(times))
        del buf
    floors = {}
    if "tf-function" in apis:  # what any tf.function step with one Python op costs, no collective
        import tensorflow as tf
        x = tf.constant(np.ones(max(1, 1024 // dtype.itemsize), dtype))
        empty = tf.function(lambda t: t + 1)
        # sdp's graph op without SdpCall is a numpy_function (zero-copy in and out, so this floor does not
        # grow with size); SdpCall costs ~30 us less (benchmarks/tf_call_op.py): a bound from it is an upper one
        one_op = tf.function(lambda t: tf.numpy_function(lambda a: a, [t], t.dtype, stateful=True))
        for key, fn in (("empty", empty), ("op", one_op)):
            times = time_calls(lambda: fn(x), 500, 20, args.target_s, "api.floor")
            floors[key] = max_over_ranks(statistics.median(times), "api.floor.med")

    def bound(api, nbytes):
        """(fastest time any design of this kind can reach for ``api`` at ``nbytes``, how it is made
        up): the engine's own time, plus for a tf.function the floor of its one Python op."""
        eng = med["numpy", nbytes][0]
        if api == "tf-function" and floors:
            add = eng + floors["op"]
            direct = med["floor", nbytes][0]
            return max(add, direct), (f"engine {eng * 1e6:.0f} us + one-numpy_function tf.function "
                                      f"{floors['op'] * 1e6:.0f} us = {add * 1e6:.0f} us; measured: sdp.allreduce "
                                      f"inside one numpy_function of a tf.function {direct * 1e6:.0f} us")
        return eng, f"engine {eng * 1e6:.0f} us (an eager collective calls it directly)"
    if sdp.rank() == 0:
        bf = busbw_factor(n)
        print("", flush=True)
        print(f"allreduce (SUM, {args.dtype}) by API, {n} ranks; time = median over iterations, max over "
              f"ranks (us); busbw GB/s; numpy = sdp.allreduce into a preallocated output", flush=True)
        cols = apis + (["floor"] if "tf-function" in apis else [])
        hdr = f"{'size':>6} " + " ".join(f"{a + ' us':>15} {'busbw':>7}" for a in cols)
        if "numpy" in apis:
            hdr += "  " + " ".join(f"{a + '/numpy':>17}" for a in apis if a != "numpy")
        print(hdr, flush=True)
        print("-" * len(hdr), flush=True)
        for nbytes in sizes:
            line = f"{fmt_size(nbytes):>6} "
            line += " ".join(f"{med[a, nbytes][0] * 1e6:15.1f} {nbytes / med[a, nbytes][0] / 1e9 * bf:7.3f}"
                             for a in cols)
            if "numpy" in apis:
                line += "  " + " ".join(f"{med['numpy', nbytes][0] / med[a, nbytes][0]:16.2f}x"
                                        for a in apis if a != "numpy")
            print(line, flush=True)
        print("", flush=True)
        print(f"targets (2 ranks, float32; {'applicable' if n == 2 and args.dtype == 'float32' else 'n/a here'}):",
              flush=True)
        for api in (a for a in apis if a != "numpy"):
            # a missed target gets the floor-based bound next to it (everything measured in this run)
            if 1024 in sizes:
                t = med[api, 1024][0] * 1e6
                ok = t <= TARGET_TF_1K_US
                why = ""
                if not ok and "numpy" in apis:
                    b, parts = bound(api, 1024)
                    why = f" (bound by the floor: {parts} -> >= {b * 1e6:.0f} us)"
                    if b * 1e6 > TARGET_TF_1K_US:
                        why += " (the floor itself misses the target)"
                print(f"  {api} 1 KB <= {TARGET_TF_1K_US:.0f} us: {t:.1f} us  {'PASS' if ok else 'FAIL'}{why}",
                      flush=True)
            for nbytes in (1 << 20, 64 << 20):
                if nbytes in sizes and "numpy" in apis:
                    r = med["numpy", nbytes][0] / med[api, nbytes][0]
                    ok = r >= TARGET_TF_VS_ENGINE
                    why = ""
                    if not ok:
                        b, parts = bound(api, nbytes)
                        why = f" (bound by the floor: {parts} -> <= {med['numpy', nbytes][0] / b:.2f}x)"
                    print(f"  {api} busbw @{fmt_size(nbytes)} >= {TARGET_TF_VS_ENGINE}x numpy: {r:.2f}x  "
                          f"{'PASS' if ok else 'FAIL'}{why}", flush=True)
        if rtt is not None:  # issue 30: eager <= 2 round trips, a tf.function <= its floor + 1 round trip
            print(f"issue 30 targets (RTT = the pipe ping-pong round trip, {rtt * 1e6:.1f} us in this run):", flush=True)
            for api, limit, what in (("tf-eager", 2 * rtt, "2 RTT"),
                                     ("tf-function", med.get(("floor", 1024), (0.0,))[0] + rtt, "floor + 1 RTT")):
                if api in apis:
                    t = med[api, 1024][0]
                    print(f"  {api} 1 KB <= {what}: {t * 1e6:.1f} us <= {limit * 1e6:.1f} us  "
                          f"{'PASS' if t <= limit else 'FAIL'}", flush=True)
        if floors:
            print(f"floor of a graph-mode op (same run, 1 KB, no collective): an empty tf.function call "
                  f"{floors['empty'] * 1e6:.1f} us; a tf.function with one numpy_function (sdp's graph op without SdpCall) "
                  f"{floors['op'] * 1e6:.1f} us; column 'floor': a tf.function whose one numpy_function calls "
                  f"sdp.allreduce (no sdp.tensorflow code)", flush=True)
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"load at end [{load}]", flush=True)
    sdp.shutdown()
    return 0
