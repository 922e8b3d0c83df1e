"""The one rank driver of the distributed tests (tests/integration/test_distributed.py).

Launched as WORLD processes on loopback (gloo, CPU) with the environment torchrun
sets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; tests/helpers/ranks.py), or by
torchrun itself::

    torchrun --nproc_per_node 2 tests/helpers/distributed_worker.py OUT_DIR CHECK [CHECK ...]

Each rank runs the named checks in order in one process group (one launch for many
checks keeps CI's added time small) and saves what each saw to OUT_DIR/checks_rank<R>.pt
after each check, an error as its traceback, so one failing check still reports the
others. The checks are tests/helpers/distributed_checks.py's and ``ddp_lists`` below:
the DDP training script of docs/integrations.md, which calls hmp.convert() in each rank.
"""

import datetime
import faulthandler
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

import hmp
from helpers import distributed_checks as checks
from helpers.models import mlp

GLOBAL_BATCH = 32
STEPS = 6
LR = 0.2
CONVERT = {"plain": {}, "modules": {"fp32_modules": [torch.nn.LayerNorm]}}


def make_model():
    return mlp(16, 64, 4, seed=0)


def global_batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(GLOBAL_BATCH, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(dim=1)
    return x, y


def train(model, x, y, steps=STEPS):
    """The training loop of the DDP run and of one process on the global batch; what it saw."""
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


def check_ddp_lists(rank, world):
    """The DDP run with the default lists, and with LayerNorm under the FP32 module rule."""
    return {variant: run(rank, world, variant) for variant in ("plain", "modules")}


CHECKS = {
    "ddp_lists": check_ddp_lists,
    "ddp": checks.check_ddp,
    "fsdp2": checks.check_fsdp2,
    "fsdp1": checks.check_fsdp1,
    "refill": checks.check_refill,
    "dcp": checks.check_dcp,
    "tp": checks.check_tp,
    "objects": checks.check_objects,
}


def main(out_dir, *names):
    torch.set_num_threads(1)
    # A rank that hangs prints every thread's stack and exits, so the test can say where it waited
    faulthandler.dump_traceback_later(150, exit=True)
    # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    print("rendezvous done", flush=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    path = os.path.join(out_dir, f"checks_rank{rank}.pt")
    for name in names:
        check = CHECKS[name]
        args = (rank, world, out_dir) if name == "dcp" else (rank, world)
        try:
            results[name] = check(*args)
        except ImportError as e:  # this torch lacks the API (FSDP2 before 2.4, ...): the test skips
            results[name] = {"lacks": f"torch {torch.__version__}: {e}"}
        except Exception:
            results[name] = {"error": traceback.format_exc()}
            print(f"rank {rank}: check {name} failed:\n{results[name]['error']}", flush=True)
        torch.save(results, path)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
