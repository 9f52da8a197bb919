"""What sdp's compiled ``SdpCall`` op saves over ``tf.numpy_function`` (issue 30, item 4).

    sdprun -np 2 python benchmarks/tf_call_op.py [--rounds 5] [--iters 500] [--bytes 1024]

sdp's graph collectives were ``tf.numpy_function`` ops; ``SdpCall`` (sdp/tensorflow/cc/sdp_ops.cc,
built by :mod:`sdp.tensorflow.build_ops`) is a compiled op whose kernel calls the same Python
function itself (input tensors as read-only numpy views, the function's aligned numpy results as
output tensors without a copy).  This times, alternately in ``--rounds`` rounds of ``--iters``
calls:

* ``empty``: a ``tf.function`` returning its input (the call's own cost);
* ``numpy_function``: one ``tf.numpy_function`` calling ``f``;
* ``compiled op``: one ``SdpCall`` calling the same ``f``;

where ``f`` is ``sdp.allreduce`` (SUM) of ``--bytes`` of float32, defined outside the traced
functions (AutoGraph converts a function defined inside one, and the converted function costs
~100 us more a call).  Rank 0 prints each round's median (the maximum over ranks) and the median
over rounds.  Needs sdp's compiled op with ``SdpCall`` (a C++ compiler, Python's and numpy's
headers).
"""
import argparse
import statistics
import sys
import time

import numpy as np

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--bytes", type=int, default=1024)
    args = p.parse_args(argv)
    import tensorflow as tf

    import sdp
    import sdp.tensorflow
    from sdp.tensorflow import build_ops
    sdp.tensorflow.init()  # (TensorFlow's threads set as for training: not spinning with several ranks a host)
    lib = build_ops.load()
    if lib is None or not lib.calls:
        sys.exit("sdp's compiled SdpCall op is not built here (python -m sdp.tensorflow.build_ops)")
    x = tf.constant(np.ones(args.bytes // 4, np.float32))

    def f(a):
        return sdp.allreduce(a, name="bench.call", op=sdp.Sum)

    def call(a):
        return [f(a)]
    fns = {"empty": tf.function(lambda t: t),
           "numpy_function": tf.function(lambda t: tf.numpy_function(f, [t], tf.float32, stateful=True)),
           "compiled op": tf.function(lambda t: lib.call(call, [t], [tf.float32])[0])}
    want = np.full(x.shape, float(sdp.size()), np.float32)
    for name, fn in fns.items():
        for _ in range(100):
            got = fn(x)
        assert name == "empty" or np.array_equal(got.numpy(), want), name
    rounds = {name: [] for name in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            sdp.barrier()
            times = []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                fn(x)
                times.append(time.perf_counter() - t0)
            med = statistics.median(times)
            rounds[name].append(float(sdp.allreduce(np.array([med]), name=f"bench.{name}", op=sdp.Max)[0]))
    if sdp.rank() == 0:
        print(f"a tf.function of one {args.bytes} B allreduce, {sdp.size()} ranks, us (each round's median, "
              f"max over ranks; {args.rounds} rounds of {args.iters} calls):")
        for name, vals in rounds.items():
            print(f"  {name:<16} median {statistics.median(vals) * 1e6:8.1f}   rounds "
                  + " ".join(f"{v * 1e6:.1f}" for v in vals))
        saved = statistics.median(rounds["numpy_function"]) - statistics.median(rounds["compiled op"])
        print(f"  the compiled op saves {saved * 1e6:.1f} us per call over numpy_function")
    sdp.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
