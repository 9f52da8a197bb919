"""``python -m kungfu.tensorflow.v1.benchmarks [--model ResNet50|VGG16] [--method CPU|NCCL|HOROVOD]
[--fuse]``: ``all_reduce_benchmark`` over the model's gradient sizes (see the package)."""
import argparse

import tensorflow as tf

from sdp_kungfu_bridge.tensorflow.v1.benchmarks import all_reduce_benchmark, model_sizes

_MODELS = {"ResNet50": "resnet50_imagenet", "VGG16": "vgg16_imagenet"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Perf Benchmarks.")
    p.add_argument("--model", default="ResNet50", choices=sorted(_MODELS), help="ResNet50 | VGG16")
    p.add_argument("--method", default="CPU", choices=["CPU", "NCCL", "HOROVOD"], help="CPU | NCCL | HOROVOD")
    p.add_argument("--fuse", action="store_true", default=False, help="one tensor of the total size")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.method == "HOROVOD":
        import sdp.tensorflow as hvd
        if not hvd.is_initialized():
            hvd.init()
    sizes = getattr(model_sizes, _MODELS[args.model])
    if args.fuse:
        sizes = [sum(sizes)]
    all_reduce_benchmark(sizes, tf.float32, args.method)


if __name__ == "__main__":
    main()
