"""Synthetic-data throughput benchmark: a Keras application model trained on random images with
sdp's DistributedGradientTape; prints images/sec per rank and in total.

    python examples/tf2_synthetic_benchmark.py                       # 1 rank
    sdprun -np 2 python examples/tf2_synthetic_benchmark.py          # 2 ranks
    sdprun -np 2 python examples/tf2_synthetic_benchmark.py --fp16-allreduce --model ResNet50 \\
        --image-size 224 --batch-size 32 --num-iters 10              # the classic Horovod setting

The defaults (MobileNetV2 on 64x64 images, batch 16, 3 iterations of 3 batches) finish in about a
minute on a 2-core CPU; every size is a flag.  The same script with ``import horovod.tensorflow as
hvd`` is Horovod's tensorflow2_synthetic_benchmark.py.
"""

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.append(str(_HERE.parent))

import common  # noqa: E402  (helpers shared by the examples; no TensorFlow yet: --help answers at once)


def parse_args(argv=None):
    p = common.argument_parser(__doc__)
    p.add_argument("--fp16-allreduce", action="store_true", help="send gradients as float16")
    p.add_argument("--model", default="MobileNetV2", help="a tf.keras.applications model name")
    p.add_argument("--image-size", type=int, default=64, help="height and width of the synthetic images")
    p.add_argument("--num-classes", type=int, default=1000, help="classes of the synthetic labels")
    p.add_argument("--batch-size", type=int, default=16, help="batch size per rank")
    p.add_argument("--num-warmup-batches", type=int, default=2, help="batches before timing starts")
    p.add_argument("--num-batches-per-iter", type=int, default=3, help="batches per timed iteration")
    p.add_argument("--num-iters", type=int, default=3, help="timed iterations")
    return p.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and flag errors before TensorFlow loads (5-20 s)

import timeit  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import sdp.tensorflow as hvd  # noqa: E402


def log(msg):
    if hvd.rank() == 0:
        print(msg, flush=True)


def main():
    args = parse_args()
    hvd.init()
    common.configure_threads(hvd.local_size())  # share the CPU cores between local ranks
    common.pin_gpu(hvd.local_rank())  # one GPU per process

    try:
        model_fn = getattr(tf.keras.applications, args.model)
    except AttributeError:
        raise SystemExit(f"unknown model {args.model!r}: use a name from tf.keras.applications") from None
    model = model_fn(weights=None, input_shape=(args.image_size, args.image_size, 3), classes=args.num_classes)
    opt = tf.keras.optimizers.SGD(0.01)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy()
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    rng = np.random.default_rng(hvd.rank())
    data = tf.constant(rng.random((args.batch_size, args.image_size, args.image_size, 3), dtype=np.float32))
    target = tf.constant(rng.integers(0, args.num_classes, (args.batch_size,)), dtype=tf.int64)

    @tf.function
    def benchmark_step(first_batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(target, model(data, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:
            # The optimizer has its variables now: start every rank from rank 0's state.
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)

    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    log(f"Model: {args.model} ({params / 1e6:.1f}M parameters), image size {args.image_size}, "
        f"batch size {args.batch_size} per rank, {'fp16' if args.fp16_allreduce else 'fp32'} allreduce")
    log(f"Number of ranks: {hvd.size()}")

    log("Running warmup...")
    benchmark_step(first_batch=True)
    for _ in range(max(0, args.num_warmup_batches - 1)):
        benchmark_step(first_batch=False)

    log("Running benchmark...")
    img_secs = []
    for i in range(args.num_iters):
        seconds = timeit.timeit(lambda: benchmark_step(first_batch=False), number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / seconds
        log(f"Iter #{i}: {img_sec:.1f} img/sec per rank")
        img_secs.append(img_sec)

    mean, conf = np.mean(img_secs), 1.96 * np.std(img_secs)
    log(f"Img/sec per rank: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {hvd.size()} rank(s): {hvd.size() * mean:.1f} +-{hvd.size() * conf:.1f}")


if __name__ == "__main__":
    main()
