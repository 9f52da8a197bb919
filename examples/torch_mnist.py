"""Data-parallel MNIST training with sdp's PyTorch face (Horovod's API) and DistributedOptimizer.

The same script runs on one process or on many; sdp averages the gradients:

    python examples/torch_mnist.py --data-dir ../shared/data/mnist
    sdprun -np 2 python examples/torch_mnist.py --data-dir ../shared/data/mnist

The recipe is Horovod's for PyTorch (change `import sdp.torch as hvd` to
`import horovod.torch as hvd` and it is a Horovod script):
  1. hvd.init(), and one GPU per process by local rank (if there are GPUs);
  2. give each rank its own shard of the training data;
  3. scale the learning rate by hvd.size();
  4. wrap the optimizer in hvd.DistributedOptimizer: each gradient's allreduce starts while
     backward() is still running, and step() waits for them;
  5. broadcast the model and optimizer state from rank 0 before training;
  6. evaluate on rank 0 only.
"""

import sys
from pathlib import Path

# mnist_data.py and common.py (helpers shared by the examples) live next to this
# script. Running from a source checkout without `pip install` also works: the
# repository root goes last on the path, so an installed sdp wins if there is one.
_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.append(str(_HERE.parent))

import common  # noqa: E402  (no torch yet: --help answers at once)


def parse_args(argv=None):
    p = common.argument_parser(__doc__)
    # --data-dir, --epochs, --batch-size, --lr, --seed
    common.add_common_args(p, epochs=1, batch_size=64, lr=0.001, seed=42)
    p.add_argument("--steps", type=int, default=None,
                   help="stop after this many training steps in total (None: no cap)")
    p.add_argument("--log-every", type=int, default=50, help="rank 0 prints the loss every this many steps")
    return p.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and flag errors before torch loads

import hashlib  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import mnist_data  # noqa: E402
import sdp.torch as hvd  # noqa: E402


class Net(torch.nn.Module):
    """The TensorFlow example's convnet (examples/tf2_mnist.py), in PyTorch."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 32, 3)
        self.conv2 = torch.nn.Conv2d(32, 64, 3)
        self.drop1 = torch.nn.Dropout(0.25)
        self.fc1 = torch.nn.Linear(12 * 12 * 64, 128)
        self.drop2 = torch.nn.Dropout(0.5)
        self.fc2 = torch.nn.Linear(128, 10)
        for layer in (self.conv1, self.conv2, self.fc1, self.fc2):  # (Keras' defaults, as the TF example:
            torch.nn.init.xavier_uniform_(layer.weight)  # Glorot uniform weights, zero biases)
            torch.nn.init.zeros_(layer.bias)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = F.relu(self.fc1(torch.flatten(self.drop1(x), 1)))
        return self.fc2(self.drop2(x))


def weights_checksum(model):
    flat = np.concatenate([p.detach().cpu().numpy().ravel() for p in model.parameters()])
    return hashlib.sha256(flat.tobytes()).hexdigest()[:16]


def evaluate(model, images, labels, device, batch_size=1000):
    """The fraction of ``images`` the model labels correctly."""
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(images), batch_size):
            logits = model(images[i:i + batch_size].to(device))
            correct += int((logits.argmax(1).cpu() == labels[i:i + batch_size]).sum())
    return correct / len(images)


def main():
    args = parse_args()

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    # Share the CPU cores between the processes on this machine.
    torch.set_num_threads(common.threads_per_process(hvd.local_size()))
    device = torch.device(f"cuda:{hvd.local_rank() % torch.cuda.device_count()}" if torch.cuda.is_available()
                          else "cpu")

    # A different seed on each rank: the ranks start from different weights, and only the
    # broadcast below makes them agree.
    torch.manual_seed(args.seed + rank)

    # Each rank trains on its own shard, cut to a common length so that every rank runs the same
    # number of steps (a rank with an extra step would wait forever for the others in allreduce).
    (x_shard, y_shard), (x_test, y_test) = mnist_data.load_sharded(args.data_dir, rank, size)
    x_shard = torch.from_numpy(x_shard).permute(0, 3, 1, 2).contiguous()  # NHWC -> NCHW
    y_shard = torch.from_numpy(y_shard)
    x_test = torch.from_numpy(x_test).permute(0, 3, 1, 2).contiguous()
    y_test = torch.from_numpy(y_test)
    per_rank = len(x_shard)
    steps_per_epoch = per_rank // args.batch_size
    if steps_per_epoch == 0:
        raise SystemExit(f"--batch-size {args.batch_size} is larger than the {per_rank} training images per rank")

    model = Net().to(device)
    # With size ranks, each step sees size times more data: scale the LR with it.
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * size)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    if rank == 0:
        print(f"training on {size} rank(s): {per_rank} images and "
              f"{steps_per_epoch} steps of {args.batch_size} per rank per epoch", flush=True)

    step, done = 0, False
    shuffle = torch.Generator().manual_seed(args.seed + rank)
    for epoch in range(1, args.epochs + 1):
        model.train()
        start, losses = time.perf_counter(), []
        order = torch.randperm(per_rank, generator=shuffle)
        for i in range(steps_per_epoch):
            idx = order[i * args.batch_size:(i + 1) * args.batch_size]
            images, labels = x_shard[idx].to(device), y_shard[idx].to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images), labels)
            loss.backward()   # each gradient's allreduce starts here, as soon as it is ready
            optimizer.step()  # waits for them, then Adam applies the averaged gradients
            losses.append(loss.item())
            step += 1
            if rank == 0 and step % args.log_every == 0:
                print(f"  step {step}: loss {np.mean(losses[-args.log_every:]):.4f}", flush=True)
            if args.steps is not None and step >= args.steps:
                done = True
                break
        elapsed = time.perf_counter() - start
        # Every rank takes part in the allreduce; only rank 0 reports.
        mean_loss = hvd.allreduce(torch.tensor(float(np.mean(losses))), name="epoch_loss")
        if rank == 0:
            print(f"epoch {epoch}: loss {float(mean_loss):.4f}, "
                  f"{len(losses) * args.batch_size * size / elapsed:.0f} images/sec, {elapsed:.1f} s", flush=True)
        if done:
            break

    if rank == 0:
        print(f"evaluating on {len(x_test)} test images", flush=True)
        print(f"test accuracy: {evaluate(model, x_test, y_test, device):.4f}", flush=True)
    print(f"weights checksum: {weights_checksum(model)}", flush=True)


if __name__ == "__main__":
    main()
