# A Horovod user's PyTorch MNIST script in the shape of Horovod's examples/pytorch/pytorch_mnist.py
# (its model, DistributedSampler, SGD with momentum, DistributedOptimizer with optional fp16
# compression, broadcast_parameters/broadcast_optimizer_state, metric_average through a named
# hvd.allreduce), written for this repository: it knows nothing about sdp and imports only
# horovod.torch.  tests/test_torch_examples.py runs it with
#     sdprun --compat horovod -np 2 python <this file> --data-dir DIR
# Differences from Horovod's file: MNIST is read from its IDX files with numpy (torchvision, which
# Horovod's uses for the download, is not installed here), --max-batches stops an epoch early, and
# each rank prints a checksum of its weights at the end.
import argparse
import gzip
import hashlib
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data.distributed

import horovod.torch as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--data-dir", required=True)
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--momentum", type=float, default=0.5)
parser.add_argument("--fp16-allreduce", action="store_true")
parser.add_argument("--max-batches", type=int, default=None)
args = parser.parse_args()


def idx(name, offset):
    path = os.path.join(args.data_dir, name)
    opener = gzip.open if os.path.exists(path + ".gz") else open
    with opener(path + ".gz" if os.path.exists(path + ".gz") else path, "rb") as f:
        return np.frombuffer(f.read(), np.uint8, offset=offset)


def dataset(split):
    images = idx(f"{split}-images-idx3-ubyte", 16).reshape(-1, 1, 28, 28).astype(np.float32) / 255.0
    labels = idx(f"{split}-labels-idx1-ubyte", 8).astype(np.int64)
    return torch.utils.data.TensorDataset(torch.from_numpy((images - 0.1307) / 0.3081), torch.from_numpy(labels))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = F.relu(self.fc1(x.view(-1, 320)))
        return F.log_softmax(self.fc2(F.dropout(x, training=self.training)), dim=1)


def metric_average(val, name):
    return hvd.allreduce(torch.tensor(val), name=name).item()


hvd.init()
torch.manual_seed(42)
torch.set_num_threads(1)
train_dataset, test_dataset = dataset("train"), dataset("t10k")
train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)
test_sampler = torch.utils.data.distributed.DistributedSampler(test_dataset, num_replicas=hvd.size(), rank=hvd.rank())
test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=1000, sampler=test_sampler)

model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), compression=compression,
                                     op=hvd.Average)

model.train()
train_sampler.set_epoch(1)
for batch_idx, (data, target) in enumerate(train_loader):
    if args.max_batches is not None and batch_idx >= args.max_batches:
        break
    optimizer.zero_grad()
    loss = F.nll_loss(model(data), target)
    loss.backward()
    optimizer.step()
    if batch_idx % 10 == 0 and hvd.rank() == 0:
        print(f"Train Epoch: 1 [{batch_idx * len(data)}/{len(train_sampler)}]\tLoss: {loss.item():.6f}", flush=True)

model.eval()
test_loss, test_accuracy = 0.0, 0.0
with torch.no_grad():
    for data, target in test_loader:
        output = model(data)
        test_loss += F.nll_loss(output, target, reduction="sum").item()
        test_accuracy += output.argmax(1).eq(target).float().sum().item()
test_loss = metric_average(test_loss / len(test_sampler), "avg_loss")
test_accuracy = metric_average(test_accuracy / len(test_sampler), "avg_accuracy")
if hvd.rank() == 0:
    print(f"Test set: Average loss: {test_loss:.4f}, Accuracy: {100.0 * test_accuracy:.2f}%", flush=True)
weights = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])
print(f"weights checksum: {hashlib.sha256(weights.tobytes()).hexdigest()[:16]}", flush=True)
