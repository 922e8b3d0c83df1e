"""Training the demo model once, in fp32 or under hmp, and measuring it."""

import contextlib
import importlib
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import hmp
from hmp.demo import data as data_mod
from hmp.demo.model import CharTransformer, n_params
from hmp.demo.procmem import start_peak
from hmp.tools import host, timing


@dataclass
class Config:
    steps: int = 300
    batch_size: int = 8
    seq_len: int = 128
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    dropout: float = 0.05
    activation: str = "gelu"
    lr: float = 2e-3
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "cpu"
    eval_windows: int = 64  # validation: this many fixed windows of seq_len characters
    timing_warmup: int = 5  # steps left out of the tokens/s figure and the time ratio: the first block (BLOCK)
    loss_window: int = 10  # the training loss reported is the mean of this many last steps
    step_delay_s: float = 0.0  # added to every training step: a slower machine, for tests of the sizing


class DeviceError(RuntimeError):
    """The requested device cannot be used."""


def resolve_device(name):
    """``auto``: cuda if available, then hpu when habana_frameworks is
    importable, else cpu. An explicit device that is not there raises."""
    if name == "auto":
        if torch.cuda.is_available():
            return "cuda"
        if importlib.util.find_spec("habana_frameworks") is not None:
            try:
                return resolve_device("hpu")
            except DeviceError:
                pass
        return "cpu"
    if name == "cpu":
        return "cpu"
    if name == "cuda":
        if torch.cuda.is_available():
            return "cuda"
        why = "this torch was built without CUDA" if torch.version.cuda is None else "no CUDA device was found"
        raise DeviceError(f"--device cuda: CUDA is not available ({why}, torch {torch.__version__})")
    if name == "hpu":
        if importlib.util.find_spec("habana_frameworks") is None:
            raise DeviceError("--device hpu: habana_frameworks is not installed")
        try:
            importlib.import_module("habana_frameworks.torch")
        except Exception as e:
            raise DeviceError(f"--device hpu: habana_frameworks.torch failed to import ({e})") from None
        hpu = getattr(torch, "hpu", None)
        if hpu is None or not hpu.is_available():
            raise DeviceError("--device hpu: no HPU is available")
        return "hpu"
    raise DeviceError(f"--device {name}: unknown device")


def _accelerator(device):
    """torch.cuda / torch.hpu for an accelerator, None for cpu."""
    return None if device == "cpu" else getattr(torch, device, None)


def _sync(device):
    acc = _accelerator(device)
    if acc is not None and hasattr(acc, "synchronize"):
        acc.synchronize()


def _mark_step(device):
    # HPU lazy mode runs the graph built so far at each mark_step
    if device == "hpu":
        importlib.import_module("habana_frameworks.torch.core").mark_step()


def build(cfg):
    """The model and its optimizer, initialised from ``cfg.seed``."""
    torch.manual_seed(cfg.seed)
    model = CharTransformer(
        data_mod.VOCAB, cfg.seq_len, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.dropout, cfg.activation
    ).to(cfg.device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )

    def schedule(step):  # linear warm-up, then cosine down to a tenth
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule)


def train_step(model, opt, sched, x, y, cfg):
    if cfg.step_delay_s:
        time.sleep(cfg.step_delay_s)
    loss = model.loss(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    _mark_step(cfg.device)
    with hmp.disable_casts():  # the optimizer keeps its fp32 arithmetic
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
    _mark_step(cfg.device)
    return loss


def make_step(batch_size=8, seed=0):
    """The demo's language model as a TARGET (hmp/tools/target.py): ``(step, state)``, one
    training step on a fixed batch of the corpus; ``python -m hmp tune`` tunes it by default."""
    cfg = Config(batch_size=batch_size, seed=seed)
    corpus = data_mod.load()
    model, opt, sched = build(cfg)
    x, y = next(data_mod.batches(corpus.train, cfg.batch_size, cfg.seq_len, torch.Generator().manual_seed(seed)))

    def step():
        return train_step(model, opt, sched, x, y, cfg)

    return step, (model, opt, sched)


@torch.no_grad()
def evaluate(model, val, cfg, chunk=32):
    """Mean cross-entropy (nats/char) over fixed validation windows."""
    model.eval()
    xs, ys = data_mod.eval_windows(val, cfg.eval_windows, cfg.seq_len)
    total, count = 0.0, 0
    for i in range(0, xs.shape[0], chunk):
        x, y = xs[i : i + chunk].to(cfg.device), ys[i : i + chunk].to(cfg.device)
        total += float(model.loss(x, y)) * y.numel()
        count += y.numel()
    model.train()
    return total / count


def train(cfg, corpus, hmp_options=None, on_step=None):
    """Train one model from ``cfg.seed`` and evaluate it.

    ``hmp_options``: None for plain fp32, or keyword arguments for
    ``hmp.convert()``; hmp is reverted before this returns, also on error.
    ``on_step(step, loss)`` is called after every step. Returns a dict with
    tokens_per_s (median step, after ``cfg.timing_warmup`` steps), train_loss
    (mean of the last ``cfg.loss_window`` steps), val_loss, wall_s, losses
    and, on an accelerator, peak_memory_mib (peak allocated by torch).
    """
    model, opt, sched = build(cfg)
    batches = data_mod.batches(corpus.train, cfg.batch_size, cfg.seq_len, torch.Generator().manual_seed(cfg.seed + 1))
    acc = _accelerator(cfg.device)
    if acc is not None and hasattr(acc, "reset_peak_memory_stats"):
        acc.reset_peak_memory_stats()
    with hmp.converted(**hmp_options) if hmp_options is not None else contextlib.nullcontext():
        times, losses = [], []
        start = time.perf_counter()
        for step in range(cfg.steps):
            x, y = next(batches)
            x, y = x.to(cfg.device), y.to(cfg.device)
            _sync(cfg.device)
            t0 = time.perf_counter()
            loss = train_step(model, opt, sched, x, y, cfg)
            loss = loss.item()  # waits for the step, as the sync below does
            _sync(cfg.device)
            times.append(time.perf_counter() - t0)
            losses.append(loss)
            if not math.isfinite(loss):
                raise FloatingPointError(f"training loss became {loss} at step {step + 1}")
            if on_step is not None:
                on_step(step, loss)
        wall = time.perf_counter() - start
        val_loss = evaluate(model, corpus.val, cfg)
    timed = times[cfg.timing_warmup :] or times
    result = {
        "tokens_per_s": cfg.batch_size * cfg.seq_len / statistics.median(timed),
        "train_loss": statistics.fmean(losses[-cfg.loss_window :]),
        "val_loss": val_loss,
        "wall_s": wall,
        "losses": losses,
        "peak_memory_mib": None,
    }
    if acc is not None and hasattr(acc, "max_memory_allocated"):
        result["peak_memory_mib"] = acc.max_memory_allocated() / 2**20
    return result


# steps of one configuration before the other's, in turn, when the two train interleaved: load on this
# machine that lasts longer than a few steps falls on both alike, and hmp converts once per block
BLOCK = 5


def _rng_state(device):
    state = {"cpu": torch.get_rng_state()}
    if device == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng(state):
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


class _Run:
    """One configuration of an interleaved training: its model, optimizer, batches and random stream."""

    def __init__(self, cfg, corpus, options):
        self.options = options
        self.model, self.opt, self.sched = build(cfg)
        gen = torch.Generator().manual_seed(cfg.seed + 1)
        self.batches = data_mod.batches(corpus.train, cfg.batch_size, cfg.seq_len, gen)
        self.rng = _rng_state(cfg.device)  # dropout draws from it: each run's as if it trained alone
        self.times, self.losses, self.samples = [], [], []  # samples: host.Sample, what the machine did too

    def converted(self):
        return hmp.converted(**self.options) if self.options is not None else contextlib.nullcontext()

    def step(self, cfg, x, y):
        """One training step, timed (host.measure): ``(loss, sample)``; ``.item()`` waits for the step."""
        return host.timed(lambda: train_step(self.model, self.opt, self.sched, x, y, cfg).item(), cfg.device)

    def block(self, cfg, steps, on_step):
        _set_rng(self.rng)
        with self.converted():
            for _ in range(steps):
                x, y = next(self.batches)
                x, y = x.to(cfg.device), y.to(cfg.device)
                loss, sample = self.step(cfg, x, y)
                self.samples.append(sample)
                self.times.append(sample.seconds)
                self.losses.append(loss)
                if not math.isfinite(loss):
                    raise FloatingPointError(f"training loss became {loss} at step {len(self.losses)}")
                on_step(loss)
        self.rng = _rng_state(cfg.device)


def train_interleaved(cfg, corpus, configurations, on_step=None):
    """Train one model per configuration (None: fp32; else keyword
    arguments for ``hmp.convert()``) from ``cfg.seed``, BLOCK steps of each
    in turn, each with its own batches and its own random stream, so each
    trains as it would alone while load from elsewhere falls on all alike.
    ``on_step(i, step, loss)`` after every step of configuration ``i``. The
    order of the blocks in a round is rotated round by round.

    Returns train()'s dict per configuration, with ``wall_s`` the sum of its
    step times, ``step_s`` every step's time and ``step_samples`` its
    host.Sample (the time, and what the machine did meanwhile: a pair of
    steps another program delayed is not judged); hmp is reverted after each
    block, also on error. The i-th steps of two configurations were taken
    BLOCK steps apart, in adjacent blocks: timing.ratio pairs them and judges
    the pairs' ratios."""
    runs = [_Run(cfg, corpus, options) for options in configurations]
    on_step = on_step or (lambda i, step, loss: None)
    for round_, first in enumerate(range(0, cfg.steps, BLOCK)):
        # the order rotated round by round (timing.rotated): neither configuration always trains first
        for i in timing.rotated(range(len(runs)), round_):
            run = runs[i]
            run.block(
                cfg, min(BLOCK, cfg.steps - first), lambda loss, i=i, run=run: on_step(i, len(run.losses) - 1, loss)
            )
    out = []
    for run in runs:
        with run.converted():
            val_loss = evaluate(run.model, corpus.val, cfg)
        timed = run.times[cfg.timing_warmup :] or run.times
        out.append(
            {
                "tokens_per_s": cfg.batch_size * cfg.seq_len / statistics.median(timed),
                "train_loss": statistics.fmean(run.losses[-cfg.loss_window :]),
                "val_loss": val_loss,
                "wall_s": sum(run.times),
                "step_s": run.times,
                "step_samples": run.samples,
                "losses": run.losses,
                "peak_memory_mib": None,
            }
        )
    return out


CAST_STEPS = 2


def count_casts(cfg, corpus, hmp_options, steps=CAST_STEPS):
    """A separate short pass under hmp.profile: the casts hmp makes per
    training step, per op. Returns ``(per_op, total, calls)`` per step, with
    ``per_op`` as ``{op: {dtype name: casts}}``, most casts first."""
    model, opt, sched = build(cfg)
    batches = data_mod.batches(corpus.train, cfg.batch_size, cfg.seq_len, torch.Generator().manual_seed(cfg.seed + 1))

    def steps_fn():
        for _ in range(steps):
            x, y = next(batches)
            loss = train_step(model, opt, sched, x.to(cfg.device), y.to(cfg.device), cfg)
        return loss

    with hmp.converted(**hmp_options):
        report = hmp.profile(steps_fn, state=(model, opt, sched), repeats=1, progress=False)  # counts, not times
    rows = report.rows()
    per_op = {r["op"]: {d: n / steps for d, n in r["cast_to"].items()} for r in rows if r["casts"]}
    per_op = dict(sorted(per_op.items(), key=lambda kv: (-sum(kv[1].values()), kv[0])))
    total = sum(r["casts"] for r in rows) / steps
    calls = sum(r["calls"] for r in rows) / steps
    return per_op, total, calls


# ---- peak memory on CPU: a fresh subprocess per configuration --------------

MEMORY_STEPS = 3


def random_batch(cfg):
    """One batch of random character ids from ``cfg.seed``, on ``cfg.device``:
    for measuring a step, where what it learns does not matter."""
    gen = torch.Generator().manual_seed(cfg.seed)
    x = torch.randint(0, data_mod.VOCAB, (cfg.batch_size, cfg.seq_len), generator=gen)
    y = torch.randint(0, data_mod.VOCAB, (cfg.batch_size, cfg.seq_len), generator=gen)
    return x.to(cfg.device), y.to(cfg.device)


def _memory_child(spec_json):
    """Subprocess entry point: a few training steps, then print, in MiB as
    JSON, the peak RSS growth over the RSS just before them (a CPU) or the
    peak torch allocated on the device (an accelerator)."""
    spec = json.loads(spec_json)
    cfg = Config(**spec["config"])
    model, opt, sched = build(cfg)
    x, y = random_batch(cfg)
    if spec["hmp_options"] is not None:
        hmp.convert(**spec["hmp_options"])
    acc = _accelerator(cfg.device)
    if acc is not None:
        acc.reset_peak_memory_stats()
        for _ in range(MEMORY_STEPS):
            train_step(model, opt, sched, x, y, cfg)
        _sync(cfg.device)
        print(json.dumps({"peak_rss_growth_mib": acc.max_memory_allocated() / 2**20}))
        return
    base, read_peak, _ = start_peak()
    for _ in range(MEMORY_STEPS):
        train_step(model, opt, sched, x, y, cfg)
    print(json.dumps({"peak_rss_growth_mib": read_peak() - base}))


def peak_rss_growth(cfg, configurations, timeout=600):
    """Peak memory (MiB) of MEMORY_STEPS training steps for each entry of
    ``configurations`` (hmp options, or None for fp32), each in a fresh
    Python process, so configurations do not share an allocator's history:
    RSS growth on a CPU (the processes run side by side: each measures only
    its own memory), torch's peak allocation on an accelerator (one after
    the other: they share the device). Returns a list of ``(mib or None,
    error or None)``."""
    if cfg.device == "cpu" and sys.platform == "win32":
        return [(None, "not measured on Windows")] * len(configurations)
    if cfg.device != "cpu":
        return [_collect(_spawn(cfg, options), timeout) for options in configurations]
    return [_collect(proc, timeout) for proc in [_spawn(cfg, options) for options in configurations]]


def _spawn(cfg, options):
    package_root = str(Path(hmp.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    code = "import sys; from hmp.demo.training import _memory_child; _memory_child(sys.argv[1])"
    spec = json.dumps({"config": asdict(cfg), "hmp_options": options})
    try:
        return subprocess.Popen(
            [sys.executable, "-c", code, spec], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
    except OSError as e:
        return e


def _collect(proc, timeout):
    if isinstance(proc, OSError):
        return None, str(proc)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as e:
        proc.kill()
        proc.communicate()
        return None, str(e)
    if proc.returncode != 0:
        tail = stderr.strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        return None, tail[0]
    return json.loads(stdout.strip().splitlines()[-1])["peak_rss_growth_mib"], None


def model_summary(cfg):
    """The model's parameter count, built on the meta device: no memory, no initialisation."""
    with torch.device("meta"):
        model = CharTransformer(
            data_mod.VOCAB, cfg.seq_len, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.dropout, cfg.activation
        )
    return n_params(model)


def matmul_time_vs_fp32(cfg, rounds=8):
    """The time this device takes to multiply the model's largest matrices
    (the MLP's ``batch*seq x d_model x 4*d_model``) in bfloat16, relative to
    float32 (a timing.Ratio, below 1 is faster): adjacent pairs in
    alternating order (timing.matmul_ratio). It bounds what any bf16 scheme
    can gain here; on some CPUs it is above 1."""
    shape = (cfg.batch_size * cfg.seq_len, cfg.d_model, 4 * cfg.d_model)
    return timing.matmul_ratio(torch.bfloat16, cfg.device, shape, rounds)
