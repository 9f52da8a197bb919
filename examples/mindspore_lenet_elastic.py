"""KungFu's elastic MindSpore guide on LeNet-5 and MNIST, on sdp (``sdprun --compat kungfu``).

    sdprun --compat kungfu -np 2 python examples/mindspore_lenet_elastic.py --schedule ''
    sdprun --compat kungfu -q -logdir logs -np 1 -w -builtin-config-port 9100 \\
        -config-server http://127.0.0.1:9100/config \\
        python examples/mindspore_lenet_elastic.py --schedule 10:2,20:1,30:2

The script imports the KungFu fork's module names (``mindspore.ops.operations.kungfu_comm_ops``,
``mindspore.nn.optim.kungfu``, ``mindspore.train.callback._kungfu``): ``--compat kungfu`` serves
them from :mod:`sdp_kungfu_bridge.mindspore` on the installed MindSpore (``pip install
sdp[mindspore]``).  The optimizer is the guide's ``KungFuMomentum`` (gradients allreduced, summed,
through ``C.Map``), the callback the guide's ``KungFuElasticCallback`` (step and parameters
broadcast from rank 0 at the first step and after every resize; ``KungFuResize`` at the schedule's
steps).  ``--schedule 10:2,20:1,30:2``: after global step 10 the job has 2 workers, after 20 one,
after 30 two again; it ends at ``--max-step`` (default: the schedule's last step + 10; without a
schedule, one pass over this worker's shard of the training set).

Data (``--data-dir``, default ``../shared/data/mnist``): one global stream of MNIST training
samples, pass after pass, each pass in its own order (seeded, the same on every worker).  A step
trains on the next ``cluster size * --batch-size`` samples of the stream, worker ``r`` on the
``r``-th ``--batch-size`` of them.  The callback counts the stream position; after a resize every
worker (a joiner too) syncs it (``sync data position OLD -> NEW``) and re-shards from there, so a
joiner continues at the same sample as the others, and no sample is trained twice or skipped.
At the end rank 0 prints ``test accuracy: X`` and every worker still in the job prints
``parameters checksum: <hex>`` (the same on every worker), ``steps run: N (global steps A..B)``
and ``data position: P`` (samples trained by the cluster).  GRAPH mode by default,
``--mode pynative`` for PYNATIVE.
"""
import argparse
import hashlib
import sys
from pathlib import Path

import numpy as np

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))

import mnist_data  # noqa: E402


def parse_schedule(text):
    """'10:2,20:1' -> {10: 2, 20: 1}; '' -> {}."""
    out = {}
    for item in filter(None, (t.strip() for t in (text or "").split(","))):
        step, size = item.split(":")
        out[int(step)] = int(size)
    return out


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data-dir", default=str(_HERE.parent.parent / "shared" / "data" / "mnist"))
    p.add_argument("--mode", choices=("graph", "pynative"), default="graph")
    p.add_argument("--schedule", default="10:2,20:1,30:2", help="global step:new size,... ('' for none)")
    p.add_argument("--max-step", type=int, default=0, help="last global step (0: see the module docstring)")
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--grouped", action="store_true", help="one fused allreduce for all gradients")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--test-samples", type=int, default=10000, help="evaluate on the first N test images")
    return p.parse_args()


ARGS = parse_args() if __name__ == "__main__" else None  # --help answers before MindSpore loads

import mindspore as ms  # noqa: E402
import mindspore.dataset as ds  # noqa: E402
from mindspore.common.initializer import Normal  # noqa: E402
from mindspore.nn.optim.kungfu import KungFuGroupedMomentum, KungFuMomentum  # noqa: E402
from mindspore.train.callback._kungfu import KungFuElasticCallback  # noqa: E402
from mindspore._c_expression import kungfu_current_cluster_size, kungfu_current_rank  # noqa: E402


class LeNet5(ms.nn.Cell):
    """LeNet-5 for 1x32x32 inputs (MNIST padded by 2)."""

    def __init__(self, num_class=10, num_channel=1):
        super().__init__()
        self.conv1 = ms.nn.Conv2d(num_channel, 6, 5, pad_mode="valid")
        self.conv2 = ms.nn.Conv2d(6, 16, 5, pad_mode="valid")
        self.fc1 = ms.nn.Dense(16 * 5 * 5, 120, weight_init=Normal(0.02))
        self.fc2 = ms.nn.Dense(120, 84, weight_init=Normal(0.02))
        self.fc3 = ms.nn.Dense(84, num_class, weight_init=Normal(0.02))
        self.relu = ms.nn.ReLU()
        self.max_pool2d = ms.nn.MaxPool2d(kernel_size=2, stride=2)
        self.flatten = ms.nn.Flatten()

    def construct(self, x):
        x = self.max_pool2d(self.relu(self.conv1(x)))
        x = self.max_pool2d(self.relu(self.conv2(x)))
        x = self.flatten(x)
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        return self.fc3(x)


def to_nchw32(images):
    """uint8 (N, 28, 28) -> float32 (N, 1, 32, 32), normalised with MNIST's mean and std."""
    x = (images.astype(np.float32) / 255.0 - 0.1307) / 0.3081
    return np.pad(x, ((0, 0), (2, 2), (2, 2)))[:, None]


def make_dataset(images, labels, batch_size):
    data = ds.NumpySlicesDataset({"image": to_nchw32(images), "label": labels.astype(np.int32)},
                                 shuffle=False)
    return data.batch(batch_size, drop_remainder=True)


def stream_indices(n_train, position, rank, size, batch_size, steps, seed):
    """Indices into the training set of worker ``rank``'s next ``steps`` batches from global
    sample ``position`` on: pass ``k`` of the stream is ``permutation(n_train)`` seeded with
    ``seed + k``; a step takes the next ``size * batch_size`` samples, worker ``rank`` the
    ``rank``-th ``batch_size`` of them.  Returns int64 (steps * batch_size,)."""
    g = (position + rank * batch_size + np.arange(steps)[:, None] * (size * batch_size)
         + np.arange(batch_size)[None, :]).ravel()
    out = np.empty_like(g)
    for k in np.unique(g // n_train):
        in_pass = g // n_train == k
        out[in_pass] = np.random.default_rng(seed + int(k)).permutation(n_train)[g[in_pass] % n_train]
    return out


def checksum(network) -> str:
    h = hashlib.sha256()
    for _name, param in network.parameters_and_names():
        h.update(np.ascontiguousarray(param.asnumpy()).tobytes())
    return h.hexdigest()[:16]


def main():
    args = ARGS or parse_args()
    ms.set_context(mode=ms.GRAPH_MODE if args.mode == "graph" else ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    ms.set_seed(args.seed)
    rank, size = kungfu_current_rank(), kungfu_current_cluster_size()
    schedule = parse_schedule(args.schedule)

    (x_train, y_train), (x_test, y_test) = mnist_data.load_mnist(args.data_dir)
    n_train = len(x_train)
    max_step = args.max_step or (max(schedule) + 10 if schedule else n_train // (size * args.batch_size))

    network = LeNet5()
    loss = ms.nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    opt_cls = KungFuGroupedMomentum if args.grouped else KungFuMomentum
    opt = opt_cls(network.trainable_params(), args.lr, args.momentum)
    model = ms.train.Model(network, loss, opt, metrics={"accuracy": ms.train.Accuracy()})
    elastic = KungFuElasticCallback(schedule, max_step=max_step, local_batch_size=args.batch_size)
    while not elastic.finished:  # one Model.train per cluster shape: a resize stops it to re-shard
        position = elastic.sync_data_position()
        rank, size = kungfu_current_rank(), kungfu_current_cluster_size()
        steps = max_step - elastic.global_step  # at most (a joiner's step is synced by the first step)
        idx = stream_indices(n_train, position, rank, size, args.batch_size, steps, args.seed)
        print("data from sample %d: rank %d of %d" % (position, rank, size), flush=True)
        model.train(1, make_dataset(x_train[idx], y_train[idx], args.batch_size), callbacks=[elastic],
                    dataset_sink_mode=False)
        if not (elastic.resized or elastic.finished):
            break  # the data ran out (a joiner's bound above): not reached with these bounds

    if elastic.detached:
        print("detached at step %d after %d steps" % (elastic.global_step, elastic.steps_run), flush=True)
        return
    first = elastic.global_step - elastic.steps_run + 1
    print("steps run: %d (global steps %d..%d)" % (elastic.steps_run, first, elastic.global_step), flush=True)
    print("data position: %d" % elastic.data_position, flush=True)
    if kungfu_current_rank() == 0:
        ms.set_context(mode=ms.GRAPH_MODE)  # evaluation compiled: PYNATIVE's batch-1000 convs are slow
        n = min(args.test_samples, len(y_test))
        test = make_dataset(x_test[:n], y_test[:n], min(500, n))
        print("test accuracy: %.4f" % model.eval(test, dataset_sink_mode=False)["accuracy"], flush=True)
    print("parameters checksum: %s" % checksum(network), flush=True)


if __name__ == "__main__":
    main()
