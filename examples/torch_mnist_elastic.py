"""Elastic data-parallel MNIST with sdp's PyTorch face (Horovod Elastic's PyTorch pattern): survives
dying workers and grows when slots are added.

    sdprun -np 3 --min-np 2 --max-np 4 --host-discovery-script ./discover.sh \\
        python examples/torch_mnist_elastic.py --data-dir ../shared/data/mnist

(``discover.sh`` prints ``localhost:3``; print more slots later and the job grows at its next
commit.)  The recipe, as in Horovod's ``pytorch_mnist_elastic.py``:

  1. init; the model, ``hvd.DistributedOptimizer`` and an ``hvd.elastic.ElasticSampler``;
  2. keep everything training resumes from in an ``hvd.elastic.TorchState`` (model, optimizer,
     sampler, ``epoch``, ``batch``, ``done``) and wrap the loop in ``@hvd.elastic.run``;
  3. ``state.sampler.record_batch`` after each batch and ``state.commit()`` every
     ``--commit-every`` batches.  When a worker dies the others raise ``HorovodInternalError``,
     roll back to the last commit, re-form with new ranks and go on: the sampler splits the
     samples not yet trained over the new ranks; new workers get rank 0's state by ``sync``;
  4. a reset callback rescales the learning rate to the new number of ranks.

``state.done`` lists every sample index trained (each step allgathers the ranks' indices); at
the end rank 0 checks that the samples the sampler counts as processed were each trained exactly
once ("samples: N trained once, 0 twice, 0 lost") -- a rollback that kept uncommitted batches,
or a re-formation that skipped some, would show here.
"""

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.append(str(_HERE.parent))

import common  # noqa: E402  (no torch yet: --help answers at once)


def parse_args(argv=None):
    p = common.argument_parser(__doc__)
    common.add_common_args(p, epochs=1, batch_size=32, lr=0.001, seed=42)
    p.add_argument("--commit-every", type=int, default=10, help="commit the state every N batches")
    p.add_argument("--steps", type=int, default=None, help="stop after this many batches in all (None: every batch)")
    return p.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and flag errors before torch loads

import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import mnist_data  # noqa: E402
import sdp.torch as hvd  # noqa: E402
from torch_mnist import Net, evaluate, weights_checksum  # noqa: E402


def main():
    args = parse_args()
    hvd.init()
    torch.set_num_threads(common.threads_per_process(hvd.local_size()))
    torch.manual_seed(args.seed + hvd.rank())  # different on each rank: sync makes them agree

    (x_train, y_train), (x_test, y_test) = mnist_data.load_mnist(args.data_dir)
    x_train = torch.from_numpy(mnist_data.preprocess(x_train)).permute(0, 3, 1, 2).contiguous()
    x_test = torch.from_numpy(mnist_data.preprocess(x_test)).permute(0, 3, 1, 2).contiguous()
    y_train, y_test = torch.from_numpy(y_train.astype(np.int64)), torch.from_numpy(y_test.astype(np.int64))
    dataset = torch.utils.data.TensorDataset(x_train, y_train)

    model = Net()
    optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=args.lr * hvd.size()),
                                         named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=args.seed)

    def on_reset():
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()
        print(f"reset: now rank {hvd.rank()} of {hvd.size()}", flush=True)

    @hvd.elastic.run
    def train(state):
        print(f"sync: rank {hvd.rank()} of {hvd.size()} at batch {state.batch}, "
              f"weights {weights_checksum(model)}", flush=True)
        for state.epoch in range(state.epoch, args.epochs):
            model.train()
            mine = list(state.sampler)  # this rank's share of the samples not trained yet
            for k in range(len(mine) // args.batch_size):
                if args.steps is not None and state.batch >= args.steps:
                    return
                idx = torch.tensor(mine[k * args.batch_size:(k + 1) * args.batch_size])
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
                loss.backward()
                optimizer.step()
                state.done.extend(hvd.allgather(idx, name="elastic.trained").tolist())
                state.sampler.record_batch(k, args.batch_size)
                state.batch += 1
                if hvd.rank() == 0 and state.batch % 10 == 0:
                    print(f"step {state.batch} on {hvd.size()} ranks: loss {loss.item():.4f}", flush=True)
                if state.batch % args.commit_every == 0:
                    state.commit()
            state.sampler.set_epoch(state.epoch + 1)
            if state.epoch + 1 < args.epochs:
                state.done = []  # (the check at the end covers the last epoch)

    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, batch=0, done=[])
    state.register_reset_callbacks([on_reset])
    t0 = time.time()
    train(state)
    print(f"final: rank {hvd.rank()} of {hvd.size()}, weights {weights_checksum(model)}", flush=True)
    if hvd.rank() == 0:
        processed = state.sampler.processed_num if state.epoch < args.epochs else len(dataset)
        order = list(range(len(dataset)))
        if sampler.shuffle:
            import random
            random.Random(sampler.seed + state.sampler.epoch).shuffle(order)
        expected = np.asarray(order[:processed], np.int64)  # what the sampler counts as trained
        counts = np.bincount(np.asarray(state.done, np.int64), minlength=len(dataset))
        print(f"samples: {int(np.sum(counts[expected] == 1))} trained once, {int(np.sum(counts > 1))} twice, "
              f"{int(np.sum(counts[expected] == 0))} lost (of {len(expected)})", flush=True)
        print(f"test accuracy: {evaluate(model, x_test, y_test, torch.device('cpu')):.4f} "
              f"({time.time() - t0:.1f} s)", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
