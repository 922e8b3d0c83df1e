"""One rank of the DistributedDataParallel check in test_distributed.py.

Launch it the way torchrun does (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
in the environment), or with torchrun itself::

    torchrun --nproc_per_node 2 tests/helpers/ddp_worker.py OUT_DIR [modules]

Each rank converts hmp (with ``modules``: LayerNorm under the FP32 module
rule too), trains a small model under DDP (gloo) on its shard of a fixed
global batch, and saves what it saw to OUT_DIR/rank<R>.pt.
"""

import datetime
import faulthandler
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

import hmp

GLOBAL_BATCH = 32
STEPS = 6
LR = 0.2
CONVERT = {"plain": {}, "modules": {"fp32_modules": [torch.nn.LayerNorm]}}


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64),
        torch.nn.LayerNorm(64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 4),
    )


def global_batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(GLOBAL_BATCH, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(dim=1)
    return x, y


def train(model, x, y, steps=STEPS):
    """The training loop both runs share; returns what it saw."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    seen = {"losses": [], "out_dtypes": set(), "grad_dtypes": set(), "norm_dtypes": set()}
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    for norm in norms:
        norm.register_forward_hook(lambda mod, args, out: seen["norm_dtypes"].add(str(out.dtype)))
    for _ in range(steps):
        out = model(x)
        loss = F.cross_entropy(out, y)
        optimizer.zero_grad()
        loss.backward()
        seen["losses"].append(loss.item())
        seen["out_dtypes"].add(str(out.dtype))
        seen["grad_dtypes"].update(str(p.grad.dtype) for p in model.parameters())
        with hmp.disable_casts():
            optimizer.step()
    return seen


def run(rank, world, variant="plain"):
    """Convert, train under DDP on this rank's shard, revert: what it saw."""
    hmp.convert(**CONVERT[variant])
    model = make_model()
    ddp = DistributedDataParallel(model)
    bucket_dtypes = set()

    def recording_allreduce(process_group, bucket):
        bucket_dtypes.add(str(bucket.buffer().dtype))
        return allreduce_hook(process_group, bucket)

    ddp.register_comm_hook(None, recording_allreduce)
    x, y = global_batch()
    shard = GLOBAL_BATCH // world
    seen = train(ddp, x[rank * shard : (rank + 1) * shard], y[rank * shard : (rank + 1) * shard])
    seen["bucket_dtypes"] = bucket_dtypes
    seen["converted"] = hmp.is_converted()
    seen["state"] = {k: v.clone() for k, v in model.state_dict().items()}
    hmp.revert()
    return seen


def main(out_dir, variant="plain"):
    torch.set_num_threads(1)
    # A rank that hangs prints every thread's stack and exits, so the test can say where it waited
    faulthandler.dump_traceback_later(90, exit=True)
    # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    print("rendezvous done", flush=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    seen = run(rank, world, variant)
    torch.save(seen, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
