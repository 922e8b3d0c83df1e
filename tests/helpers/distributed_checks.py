"""The batched checks of tests/integration/test_distributed.py, one function a check: each
runs in every rank of one process group (tests/helpers/distributed_worker.py starts them) and
returns what it saw; the test file asserts."""

import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import hmp
from helpers.models import Block, blocks
from hmp.core.cache import size as cache_size

GLOBAL_BATCH = 16
STEPS = 4
BF16 = torch.bfloat16


def _fsdp2():
    """(fully_shard, MixedPrecisionPolicy): public in torch.distributed.fsdp from torch 2.6, which
    first runs it on CPU (2.4's and 2.5's, under torch.distributed._composable, make CUDA streams)."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError as e:
        raise ImportError(f"FSDP2 runs on CPU from torch 2.6 ({e})") from e
    return fully_shard, MixedPrecisionPolicy


def _dtensor():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        from torch.distributed._tensor import DTensor
    return DTensor


def _distribute_tensor():
    try:
        from torch.distributed.tensor import distribute_tensor
    except ImportError:
        from torch.distributed._tensor import distribute_tensor
    return distribute_tensor


def _mesh(world):
    from torch.distributed.device_mesh import init_device_mesh

    # a CPU mesh said outright: by default the accelerator is picked when the machine has one,
    # and gloo with CUDA tensors hangs
    return init_device_mesh("cpu", (world,))


def global_batch(d_in=16, classes=4):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(GLOBAL_BATCH, d_in, generator=g)
    y = (x[:, :classes] * 3 + 0.3 * torch.randn(GLOBAL_BATCH, classes, generator=g)).argmax(dim=1)
    return x, y


def my_shard(t, rank, world):
    n = t.shape[0] // world
    return t[rank * n : (rank + 1) * n]


def full_state(model):
    DTensor = _dtensor()
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()
    }


def _local(t):
    return t.to_local() if isinstance(t, _dtensor()) else t


def _dtypes(tensors):
    return sorted({str(_local(t).dtype) for t in tensors if t is not None})


@contextlib.contextmanager
def kept_bytes(into):
    """Bytes of the storages autograd saved for backward that are still allocated when the forward
    ends (what a forward keeps alive until backward; FSDP frees the gathered weights it saved)."""
    saved = []

    def pack(t):
        try:
            saved.append(t.untyped_storage())
        except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield
    into.append(sum({s.data_ptr(): s.nbytes() for s in saved if s.nbytes()}.values()))


def _mode(mode):
    """The precision machinery a run trains under, entered around each forward and loss."""
    if mode == "autocast":
        return torch.autocast("cpu", dtype=BF16)
    return contextlib.nullcontext()


def train(model, x, y, mode, steps=STEPS, lr=0.05):
    """Train with AdamW; hmp is converted by the caller for mode 'hmp'. What it saw."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    seen = {"losses": [], "out_dtypes": set(), "kept": [], "gathered": set()}
    hooks = [
        m.register_forward_pre_hook(lambda mod, args: seen["gathered"].add(str(_local(mod.weight).dtype)))
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
    ]
    for _ in range(steps):
        with kept_bytes(seen["kept"]), _mode(mode):
            out = model(x)
            loss = F.cross_entropy(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        seen["losses"].append(loss.item())
        seen["out_dtypes"].add(str(out.dtype))
    for h in hooks:
        h.remove()
    params = list(model.parameters())
    seen["param_dtypes"] = _dtypes(params)
    seen["state_dtypes"] = _dtypes(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    seen["state"] = full_state(model)
    seen["out_dtypes"] = sorted(seen["out_dtypes"])
    seen["gathered"] = sorted(seen["gathered"])
    return seen


@contextlib.contextmanager
def converted(mode, **kwargs):
    if mode == "hmp":
        with hmp.converted(**kwargs):
            yield
    else:
        yield


def grad_dtypes_after_backward(model, x, y, mode):
    with _mode(mode):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    out = _dtypes(p.grad for p in model.parameters())
    model.zero_grad()
    return out


# -- the checks: each returns what it saw --------------------------------------------------------


def check_ddp(rank, world):
    """DDP with static_graph and a compressing comm hook (fp16: gloo has no bf16 one), and DDP
    with find_unused_parameters and activation checkpointing, under hmp; each also as one
    process on the global batch."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.checkpoint import checkpoint

    class Unused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = blocks()
            self.spare = torch.nn.Linear(4, 4)  # never used: find_unused_parameters

        def forward(self, x):
            return checkpoint(self.body, x, use_reentrant=False)

    x, y = global_batch()
    xs, ys = my_shard(x, rank, world), my_shard(y, rank, world)
    seen = {}
    for name, build, wrap in (
        ("static_graph_fp16_hook", blocks, lambda m: DDP(m, static_graph=True)),
        ("find_unused_checkpoint", Unused, lambda m: DDP(m, find_unused_parameters=True)),
    ):
        with hmp.converted():
            model = build()
            ddp = wrap(model)
            if name.startswith("static"):
                ddp.register_comm_hook(None, fp16_compress_hook)
            run = train(ddp, xs, ys, "hmp")
            run["grad_dtypes"] = grad_dtypes_after_backward(ddp, xs, ys, "hmp")
            run["state"] = full_state(model)
            single = train(build(), x, y, "hmp")
        run["single_losses"], run["single_state"] = single["losses"], single["state"]
        seen[name] = run
    return seen


def _policy_runs(rank, world, policy, shard, finish):
    """The runs both FSDPs are checked with: fp32, the mixed-precision ``policy`` alone, policy +
    autocast, policy + hmp O1, hmp alone with the cache on and off. ``shard(model, mp)`` wraps a
    fresh model; ``finish(model, run)`` adds what that FSDP shows after the run."""
    x, y = global_batch()
    xs, ys = my_shard(x, rank, world), my_shard(y, rank, world)
    seen = {}
    for name, mode, mp, cache in (
        ("fp32", None, None, True),
        ("policy", None, policy, True),
        ("policy_autocast", "autocast", policy, True),
        ("policy_hmp", "hmp", policy, True),
        ("hmp", "hmp", None, True),
        ("hmp_no_cache", "hmp", None, False),
    ):
        model = shard(blocks(), mp)
        with converted(mode, cache=cache):
            run = train(model, xs, ys, mode)
            run["grad_dtypes"] = grad_dtypes_after_backward(model, xs, ys, mode)
            with torch.no_grad(), _mode(mode):
                run["eval"] = model(xs).float()
        finish(model, run)
        seen[name] = run
    return seen


def check_fsdp2(rank, world):
    """FSDP2 (fully_shard) on a CPU mesh, in the runs of _policy_runs."""
    fully_shard, MixedPrecisionPolicy = _fsdp2()
    mesh = _mesh(world)

    def shard(model, mp):
        kwargs = {"mesh": mesh} if mp is None else {"mesh": mesh, "mp_policy": mp}
        for unit in model:  # every layer a unit of its own: the root holds no parameter
            fully_shard(unit, **kwargs)
        fully_shard(model, **kwargs)
        return model

    def finish(model, run):
        run["sharded"] = all(isinstance(p, _dtensor()) for p in model.parameters())

    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
    return _policy_runs(rank, world, policy, shard, finish)


def check_fsdp1(rank, world):
    """FSDP1 (FullyShardedDataParallel) on CPU, in the runs of _policy_runs."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    def shard(model, mp):
        policy = ModuleWrapPolicy({Block})
        return FSDP(
            model, device_id=torch.device("cpu"), auto_wrap_policy=policy, mixed_precision=mp, use_orig_params=True
        )

    def finish(model, run):
        with FSDP.summon_full_params(model):
            run["state"] = {k: v.detach().clone() for k, v in model.module.state_dict().items()}

    policy = MixedPrecision(param_dtype=BF16, reduce_dtype=torch.float32)
    return _policy_runs(rank, world, policy, shard, finish)


def _fsdp2_model(world, seed=0):
    fully_shard, _ = _fsdp2()
    mesh = _mesh(world)
    model = blocks(seed=seed)
    for unit in model:  # every parameter resharded after forward, refilled at the next
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def check_refill(rank, world):
    """The weight-cast cache after FSDP2 refills an unsharded parameter in place: a forward whose
    output (and graph) is kept, then new weights through set_model_state_dict and in-place edits
    of the sharded parameters, each followed by another forward, all while the first graph lives.
    Wide layers: the allocator then often hands a refilled parameter its old address (counted)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    distribute_tensor = _distribute_tensor()
    fully_shard, _ = _fsdp2()
    width, cycles = 1024, 3

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Linear(width, width), torch.nn.Linear(width, 4))

    x, _ = global_batch()
    xs = my_shard(x, rank, world)
    g = torch.Generator().manual_seed(7)
    loads = [
        {k: torch.randn(v.shape, generator=g) * 0.05 for k, v in build().state_dict().items()} for _ in range(cycles)
    ]

    def program(model, load):
        outs = [model(xs)]  # kept: its graph holds the casts of the first weights
        used.append(cache_size() > 0)
        for state in loads:
            load(model, state)
            outs.append(model(xs))
        for _ in range(cycles):
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(-0.5)  # in place (FSDP2: the sharded parameters)
            outs.append(model(xs))
        return [o.detach().float() for o in outs]

    def load_sharded(model, state):  # a sharded state dict (what dcp.load reads), copied into each shard
        sharded = {
            k: distribute_tensor(state[k], v.device_mesh, v.placements) for k, v in get_model_state_dict(model).items()
        }
        set_model_state_dict(model, sharded)

    seen, used = {}, []
    for cache in (True, False):
        model = build()
        mesh = _mesh(world)
        for unit in model:  # every parameter resharded after forward, refilled at the next
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
        addresses = []
        model[1].register_forward_pre_hook(lambda mod, args, at=addresses: at.append(_local(mod.weight).data_ptr()))
        with hmp.converted(cache=cache):
            outs = program(model, load_sharded)
        reused = sum(a == b for a, b in zip(addresses, addresses[1:]))
        seen["cache" if cache else "no_cache"] = {"outs": outs, "used": used.pop(), "reused": reused}
    with hmp.converted(cache=False):  # what one process computes with the same weights
        seen["expected"] = program(build(), lambda model, state: model.load_state_dict(state))
    return seen


def check_dcp(rank, world, out_dir):
    """torch.distributed.checkpoint save and load of an FSDP2 model and its optimizer while
    converted: float32 stays float32, bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    x, y = global_batch()
    xs, ys = my_shard(x, rank, world), my_shard(y, rank, world)
    path = os.path.join(out_dir, "dcp")
    with hmp.converted():
        model = _fsdp2_model(world)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        F.cross_entropy(model(xs), ys).backward()
        opt.step()
        opt.zero_grad()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        saved = full_state(model)
        loaded = _fsdp2_model(world, seed=3)
        opt2 = torch.optim.AdamW(loaded.parameters(), lr=0.05)
        F.cross_entropy(loaded(xs), ys).backward()  # builds the optimizer state to load into
        opt2.step()
        opt2.zero_grad()
        msd2, osd2 = get_state_dict(loaded, opt2)
        state = {"model": msd2, "optim": osd2}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(loaded, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
        after = full_state(loaded)
        # both train on identically from here
        losses = []
        for m, o in ((model, opt), (loaded, opt2)):
            loss = F.cross_entropy(m(xs), ys)
            loss.backward()
            o.step()
            losses.append(loss.item())
    return {
        "saved": saved,
        "loaded": after,
        "losses": losses,
        "dtypes": _dtypes(list(loaded.parameters())),
        "state_dtypes": _dtypes(v for s in opt2.state.values() for v in s.values() if torch.is_tensor(v)),
    }


def check_tp(rank, world):
    """Tensor parallel (DTensor parameters, colwise then rowwise) under hmp, against one process."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = _mesh(world)
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    single = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    single.load_state_dict(mlp.state_dict())
    parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x, _ = global_batch()  # every rank the same batch: TP splits the weights, not the data
    with hmp.converted():
        out = mlp(x)
        out.float().pow(2).mean().backward()
        want = single(x)
        want.float().pow(2).mean().backward()
    DTensor = _dtensor()
    return {
        "out": out.detach().float(),
        "want": want.detach().float(),
        "out_dtype": str(out.dtype),
        "dtensor_params": all(isinstance(p, DTensor) for p in mlp.parameters()),
        "param_dtypes": _dtypes(mlp.parameters()),
        "grad_dtypes": _dtypes(p.grad for p in mlp.parameters()),
        "grads": {n: p.grad.full_tensor() for n, p in mlp.named_parameters()},
        "want_grads": {n: p.grad for n, p in single.named_parameters()},
    }


def check_objects(rank, world):
    """Object collectives while converted, sending an object that holds listed torch functions
    captured before convert() (what a config or a module keeps from its default arguments)."""
    captured = {"project": F.linear, "mm": torch.mm, "rank": rank}
    seen = {}
    with hmp.converted():
        assert F.linear is not captured["project"]  # hmp's wrapper stands there now
        gathered = [None] * world
        dist.all_gather_object(gathered, captured)
        seen["gathered_ranks"] = [g["rank"] for g in gathered]
        # saved by name: a converted receiver finds hmp's wrapper under it, which casts
        a, b = torch.randn(2, 4), torch.randn(4, 4)
        seen["gathered_cast"] = [str(g["project"](a, b).dtype) + " " + str(g["mm"](a, b).dtype) for g in gathered]
        box = [captured if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        seen["broadcast_rank"] = box[0]["rank"]
    return seen
