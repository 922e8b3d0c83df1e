"""One rank of the FSDP2 check in test_distributed.py.

Each rank trains the same small model twice under hmp, sharded with
``torch.distributed.fsdp.fully_shard`` (gloo), once with the weight-cast
cache on and once with ``cache=False``; the optimizer step is a plain
``optimizer.step()`` (no ``disable_casts()``). It saves what it saw to
OUT_DIR/fsdp_rank<R>.pt.
"""

import datetime
import faulthandler
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import hmp

GLOBAL_BATCH = 16
STEPS = 5


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    )


def global_batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(GLOBAL_BATCH, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(dim=1)
    return x, y


def _dtypes(tensors):
    out = set()
    for t in tensors:
        out.add(str(t.dtype))
        if isinstance(t, DTensor):
            out.add(str(t.to_local().dtype))
    return out


def run(rank, world, use_cache):
    model = make_model()
    # a CPU mesh said outright: by default fully_shard picks the accelerator
    # when the machine has one, and gloo with CUDA tensors hangs
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    x, y = global_batch()
    shard = GLOBAL_BATCH // world
    x, y = x[rank * shard : (rank + 1) * shard], y[rank * shard : (rank + 1) * shard]
    seen = {"losses": [], "out_dtypes": set()}
    hmp.convert(cache=use_cache)
    try:
        for _ in range(STEPS):
            out = model(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            opt.step()  # no disable_casts(): hmp runs it uncast by itself
            opt.zero_grad(set_to_none=False)
            seen["losses"].append(loss.item())
            seen["out_dtypes"].add(str(out.dtype))
        with torch.no_grad():
            seen["eval"] = model(x).float()
    finally:
        hmp.revert()
    params = list(model.parameters())
    seen["sharded"] = all(isinstance(p, DTensor) for p in params)
    seen["param_dtypes"] = _dtypes(params)
    seen["grad_dtypes"] = _dtypes(p.grad for p in params)
    seen["state_dtypes"] = _dtypes(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    seen["state"] = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    return seen


def main(out_dir):
    torch.set_num_threads(1)
    # A rank that hangs prints every thread's stack and exits, so the test can say where it waited
    faulthandler.dump_traceback_later(90, exit=True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    print("rendezvous done", flush=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"cache": run(rank, world, True), "no_cache": run(rank, world, False)}
    torch.save(result, os.path.join(out_dir, f"fsdp_rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
