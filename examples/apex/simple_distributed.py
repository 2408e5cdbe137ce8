"""A CUDA-only Apex training script in the style of Apex's ``examples/simple/distributed``.

Written as an Apex user wrote them (``import apex``, ``.cuda()``, NCCL, ``amp.initialize``,
``apex.parallel.DistributedDataParallel``, ``amp.scale_loss``), with a small ResNet-style model
whose batch norms become SyncBatchNorm, each followed by ``ReLU(inplace=True)``. It is run
UNCHANGED by the tests, on a CPU, through mpnb:

    python -m mpnb.apex --cpu examples/apex/simple_distributed.py
    torchrun --nproc_per_node=2 -m mpnb.apex --cpu examples/apex/simple_distributed.py

On a GPU machine with mpnb the same commands run without ``--cpu``. Every rank prints one JSON
line at the end (first and final loss, the loss scale, a checksum of its parameters).
"""

import argparse
import json
import os
import sys

import torch
from apex import amp
from apex.parallel import DistributedDataParallel, convert_syncbn_model

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", default=int(os.environ.get("LOCAL_RANK", 0)), type=int)
parser.add_argument("--opt-level", default="O1")
parser.add_argument("--steps", default=30, type=int)
parser.add_argument("--lr", default=0.05, type=float)
args = parser.parse_args()

args.distributed = False
if "WORLD_SIZE" in os.environ:
    args.distributed = int(os.environ["WORLD_SIZE"]) > 1

if args.distributed:
    torch.cuda.set_device(args.local_rank)
    torch.distributed.init_process_group(backend="nccl", init_method="env://")

torch.backends.cudnn.benchmark = True
torch.manual_seed(0)
torch.cuda.manual_seed(0)


class BasicBlock(torch.nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(channels)
        self.relu = torch.nn.ReLU(inplace=True)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(channels)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


model = torch.nn.Sequential(
    torch.nn.Conv2d(3, 16, 3, padding=1, bias=False),
    torch.nn.BatchNorm2d(16),
    torch.nn.ReLU(inplace=True),
    BasicBlock(16),
    torch.nn.AdaptiveAvgPool2d(1),
    torch.nn.Flatten(),
    torch.nn.Linear(16, 4),
)
if args.distributed:
    model = convert_syncbn_model(model)
model = model.cuda()

# Each rank trains on its own fixed batch of synthetic images; the class (one of 4) is given by
# the signs of the red and green channels' means.
rank = torch.distributed.get_rank() if args.distributed else 0
gen = torch.Generator().manual_seed(1000 + rank)
images = torch.randn(32, 3, 16, 16, generator=gen) + 0.3 * torch.randn(32, 3, 1, 1, generator=gen)
means = images.mean((2, 3))
labels = (means[:, 0] > 0).long() + 2 * (means[:, 1] > 0).long()
x = images.cuda()
y = labels.to(torch.device("cuda", args.local_rank))

optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level, verbosity=0)
if args.distributed:
    model = DistributedDataParallel(model)

loss_fn = torch.nn.CrossEntropyLoss().cuda()
losses = []
for _ in range(args.steps):
    optimizer.zero_grad()
    output = model(x)
    loss = loss_fn(output.float(), y)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    losses.append(loss.item())
torch.cuda.synchronize()

checksum = sum(p.detach().double().sum().item() for p in model.parameters())
summary = {
    "rank": rank,
    "world_size": torch.distributed.get_world_size() if args.distributed else 1,
    "first_loss": losses[0],
    "final_loss": losses[-1],
    "loss_scale": amp._amp_state.loss_scalers[0].loss_scale(),
    "param_checksum": checksum,
    "device": str(x.device),
}
if args.local_rank == 0:
    print("final loss = ", loss.item())
# one write of the whole line (print writes the text and the newline separately): the ranks
# share the launcher's stdout, and two lines written in pieces can end up on one line
sys.stdout.write(json.dumps(summary) + "\n")
sys.stdout.flush()
