"""Data-parallel MNIST training with PyTorch's DistributedDataParallel on sdp's torch.distributed backend.

The same script runs on one process or on many; DDP averages the gradients and sdp's engine
carries them (no NCCL, no Gloo):

    python examples/torch_ddp_mnist.py --data-dir ../shared/data/mnist
    sdprun -np 2 python examples/torch_ddp_mnist.py --data-dir ../shared/data/mnist

The recipe is PyTorch's usual DDP one, with the backend named "sdp":
  1. import sdp.torch.distributed (it registers the backend), then
     torch.distributed.init_process_group(backend="sdp"): under sdprun it needs no MASTER_ADDR;
  2. give each rank its own shard of the training data;
  3. scale the learning rate by the world size;
  4. wrap the model in DistributedDataParallel, which broadcasts rank 0's weights and averages
     gradients over ranks during backward();
  5. evaluate on rank 0 only; every rank prints its weights' checksum (all equal).
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
    return p.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and flag errors before torch loads

import hashlib  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import mnist_data  # noqa: E402
import sdp.torch.distributed  # noqa: E402,F401  (registers the "sdp" backend)


def build_model():
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 16, 3), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Flatten(),
        torch.nn.Linear(16 * 12 * 12, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 10))


def weights_checksum(model):
    flat = b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())
    return hashlib.sha256(flat).hexdigest()[:16]


def to_nchw(images):
    """(N, 28, 28, 1) float32 -> a (N, 1, 28, 28) tensor."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()


@torch.no_grad()
def evaluate(model, images, labels, batch_size=1000):
    model.eval()
    correct = 0
    for i in range(0, len(images), batch_size):
        correct += (model(images[i:i + batch_size]).argmax(1) == labels[i:i + batch_size]).sum().item()
    model.train()
    return correct / len(images)


def main():
    args = parse_args()

    dist.init_process_group(backend="sdp")
    rank, size = dist.get_rank(), dist.get_world_size()
    # Share the CPU cores between the processes on this machine.
    torch.set_num_threads(common.threads_per_process(sdp.api.local_size()))

    # A different seed on each rank: the ranks start from different weights, and
    # DDP's broadcast from rank 0 makes them agree.
    torch.manual_seed(args.seed + rank)

    # Each rank trains on its own shard, cut to a common length so that every
    # rank runs the same number of steps.
    (x_shard, y_shard), (x_test, y_test) = mnist_data.load_sharded(args.data_dir, rank, size)
    x_shard, y_shard = to_nchw(x_shard), torch.from_numpy(y_shard)
    steps_per_epoch = len(x_shard) // args.batch_size
    if steps_per_epoch == 0:
        raise SystemExit(f"--batch-size {args.batch_size} is larger than the {len(x_shard)} training images per rank")

    model = DDP(build_model())
    # With size ranks, each step sees size times more data: scale the LR with it.
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * size)

    if rank == 0:
        print(f"training on {size} rank(s): {len(x_shard)} images and "
              f"{steps_per_epoch} steps of {args.batch_size} per rank per epoch", flush=True)

    step, done = 0, False
    gen = torch.Generator().manual_seed(args.seed + rank)
    for epoch in range(1, args.epochs + 1):
        start = time.perf_counter()
        order = torch.randperm(len(x_shard), generator=gen)
        losses = []
        for i in range(steps_per_epoch):
            batch = order[i * args.batch_size:(i + 1) * args.batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(model(x_shard[batch]), y_shard[batch])
            loss.backward()  # DDP averages the gradients over all ranks here
            opt.step()
            losses.append(loss.detach())
            step += 1
            if args.steps is not None and step >= args.steps:
                done = True
                break
        elapsed = time.perf_counter() - start
        # Every rank takes part in the allreduce; only rank 0 reports.
        mean_loss = torch.stack(losses).mean()
        dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
        if rank == 0:
            print(f"epoch {epoch}: loss {mean_loss.item():.4f}, "
                  f"{len(losses) * args.batch_size * size / elapsed:.0f} images/sec, {elapsed:.1f} s", flush=True)
        if done:
            break

    if rank == 0:
        print(f"evaluating on {len(x_test)} test images", flush=True)
        accuracy = evaluate(model.module, to_nchw(x_test), torch.from_numpy(y_test))
        print(f"test accuracy: {accuracy:.4f}", flush=True)

    print(f"weights checksum: {weights_checksum(model.module)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
