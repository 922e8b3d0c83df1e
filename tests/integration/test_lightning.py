"""hmp.integrations.lightning.HMPPrecision trains real LightningModules."""

import pytest
import torch
import torch.nn.functional as F

import hmp

pl = pytest.importorskip("lightning.pytorch")
from helpers.ranks import ROOT, run_ranks  # noqa: E402

from hmp.integrations.lightning import HMPFSDPPrecision, HMPPrecision  # noqa: E402

LIGHTNING_WORKER = ROOT / "tests" / "helpers" / "lightning_worker.py"

ACCELERATORS = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def dataset(n=512, dim=16, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, classes, generator=g)
    y = (x @ w).argmax(dim=1)
    return torch.utils.data.TensorDataset(x, y)


def loader(**kwargs):
    return torch.utils.data.DataLoader(dataset(**kwargs), batch_size=64, shuffle=False)


class MLP(pl.LightningModule):
    """Records, for every training step, what hmp did inside it."""

    def __init__(self, dim=16, classes=4, lr=0.5, optimizer="sgd", fail_at=None):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(dim, 32), torch.nn.ReLU(), torch.nn.Linear(32, classes))
        self.lr = lr
        self.optimizer = optimizer
        self.fail_at = fail_at
        self.seen = []  # (hidden dtype, logits dtype, loss, converted, casts enabled, bf16 list)
        self.step_casts = []  # casts_enabled() inside optimizer.step, before and after the closure
        self.hook_casts = []

    def training_step(self, batch, batch_idx):
        if self.fail_at is not None and self.global_step == self.fail_at:
            raise RuntimeError("boom in training_step")
        x, y = batch
        hidden = self.net[0](x)
        logits = self.net[2](self.net[1](hidden))
        loss = F.cross_entropy(logits, y)
        self.seen.append(
            (
                hidden.dtype,
                logits.dtype,
                loss.item(),
                hmp.is_converted(),
                hmp.casts_enabled(),
                hmp.effective_lists()["bf16"],
            )
        )
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.val_dtype = logits.dtype

    def on_before_optimizer_step(self, optimizer):
        self.hook_casts.append(hmp.casts_enabled())

    def configure_optimizers(self):
        module = self
        base = {"adam": torch.optim.Adam, "lbfgs": torch.optim.LBFGS}.get(self.optimizer, torch.optim.SGD)

        class Recording(base):
            def step(self, closure=None):
                before = hmp.casts_enabled()

                def recorded():
                    with torch.enable_grad():
                        return closure()

                out = super().step(recorded)
                module.step_casts.append((before, hmp.casts_enabled()))
                return out

        extra = {"max_iter": 3} if self.optimizer == "lbfgs" else {}
        return Recording(self.parameters(), lr=self.lr, **extra)


def trainer(plugin, accelerator="cpu", **kwargs):
    settings = dict(
        accelerator=accelerator,
        devices=1,
        max_epochs=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    settings.update(kwargs)
    return pl.Trainer(plugins=[plugin], **settings)


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_trains_in_bf16_with_fp32_params(accelerator):
    model = MLP()
    plugin = HMPPrecision(opt_level="O1", bf16_file_path=None, fp32_file_path=None, isVerbose=False)
    trainer(plugin, accelerator).fit(model, loader())
    assert len(model.seen) == 3 * 8
    hidden, logits, _, converted, casting, _ = model.seen[0]
    assert (hidden, logits, converted, casting) == (torch.bfloat16, torch.bfloat16, True, True)
    losses = [s[2] for s in model.seen]
    assert sum(losses[-4:]) < 0.6 * sum(losses[:4])  # it learns
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in model.parameters())
    # the optimizer step (and the hooks before it) ran with casts off; the closure with casts on
    assert model.step_casts and all(s == (False, False) for s in model.step_casts)
    assert model.hook_casts and not any(model.hook_casts)
    assert not hmp.is_converted()
    assert hmp.casts_enabled()
    assert trainer(plugin, accelerator).precision == "bf16-mixed"


def test_gradient_clipping_and_adam():
    model = MLP(optimizer="adam", lr=0.02)
    plugin = HMPPrecision()
    calls = []
    original = plugin.clip_grad_by_norm

    def spy(optimizer, clip_val):
        calls.append(hmp.casts_enabled())
        return original(optimizer, clip_val)

    plugin.clip_grad_by_norm = spy
    trainer(plugin, gradient_clip_val=0.5, max_epochs=2).fit(model, loader())
    assert calls and not any(calls)
    losses = [s[2] for s in model.seen]
    assert losses[-1] < losses[0]
    assert not hmp.is_converted()


def test_an_optimizer_that_calls_the_closure_repeatedly():
    model = MLP(optimizer="lbfgs", lr=0.5)
    trainer(HMPPrecision(), max_epochs=1).fit(model, loader())
    assert len(model.seen) > len(model.step_casts) == 8  # LBFGS evaluates the closure several times a step
    assert all(s[0] == torch.bfloat16 and s[4] for s in model.seen)  # every evaluation runs with casts on
    assert all(s == (False, False) for s in model.step_casts)
    assert model.seen[-1][2] < model.seen[0][2]
    assert not hmp.is_converted()


def test_validation_and_test_runs_convert_and_revert():
    model = MLP()
    plugin = HMPPrecision()
    t = trainer(plugin, max_epochs=1)
    t.fit(model, loader(), loader(seed=1))
    assert model.val_dtype == torch.bfloat16
    assert not hmp.is_converted()
    model.val_dtype = None
    t.validate(model, loader(seed=1), verbose=False)
    assert model.val_dtype == torch.bfloat16
    assert not hmp.is_converted()


def test_two_trainers_with_different_lists_do_not_leak(tmp_path):
    matmul_only = tmp_path / "bf16.txt"
    matmul_only.write_text("matmul\n")
    first, second = MLP(), MLP()
    trainer(HMPPrecision(), max_epochs=1).fit(first, loader())
    assert not hmp.is_converted()
    trainer(HMPPrecision(bf16_file_path=matmul_only), max_epochs=1).fit(second, loader())
    assert not hmp.is_converted()
    assert first.seen[0][0] == torch.bfloat16 and "linear" in first.seen[0][5]
    assert second.seen[0][0] == torch.float32 and second.seen[0][5] == ["matmul"]  # linear not listed: fp32
    assert all(s[5] == ["matmul"] for s in second.seen)


def test_a_failing_run_reverts_and_the_next_trainer_is_clean():
    model = MLP(fail_at=2)
    with pytest.raises(RuntimeError, match="boom in training_step"):
        trainer(HMPPrecision(), max_epochs=1).fit(model, loader())
    assert not hmp.is_converted()
    assert hmp.casts_enabled()
    healthy = MLP()
    trainer(HMPPrecision(), max_epochs=1).fit(healthy, loader())
    assert healthy.seen[0][0] == torch.bfloat16
    assert not hmp.is_converted()


def test_a_conversion_made_before_the_run_is_restored(tmp_path):
    mine = tmp_path / "mine.txt"
    mine.write_text("matmul\n")
    hmp.convert(bf16_file_path=mine, low_precision_type=torch.float16)
    before = hmp.effective_lists()
    model = MLP()
    trainer(HMPPrecision(), max_epochs=1).fit(model, loader())
    assert model.seen[0][0] == torch.bfloat16  # the plugin's lists during the run
    assert hmp.is_converted() and hmp.effective_lists() == before
    assert torch.randn(2, 3).matmul(torch.randn(3, 2)).dtype == torch.float16


class Logging(MLP):
    """Logs the loss (epoch mean) and a constant; a callback does arithmetic."""

    def __init__(self):
        super().__init__()
        self.losses = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.detach().clone())
        self.log("loss", loss, on_step=False, on_epoch=True)
        self.log_dict({"const": torch.tensor(2.3659)}, on_step=True, on_epoch=False)
        return loss


class Arithmetic(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.product = (outputs["loss"].detach() * 0.5).dtype


def test_lightning_bookkeeping_is_uncast():
    model, callback = Logging(), Arithmetic()
    trainer(HMPPrecision(), max_epochs=1, callbacks=[callback]).fit(model, loader())
    assert model.seen[0][0] == torch.bfloat16  # the step itself ran under hmp
    metrics = model.trainer.callback_metrics
    assert metrics["const"].item() == torch.tensor(2.3659).item()  # bf16 would be 2.359375
    # the epoch mean Lightning reduced, against float64 arithmetic on the same logged tensors
    mean = torch.stack(model.losses).double().mean()
    assert metrics["loss"].dtype == torch.float32
    assert abs(metrics["loss"].double() - mean) <= 1e-6 * mean  # a bf16 product is off by ~1e-3
    assert callback.product == torch.float32
    assert hmp.casts_enabled() and not hmp.is_converted()


class ManualWithClosure(MLP):
    def __init__(self):
        super().__init__(optimizer="lbfgs")
        self.automatic_optimization = False
        self.closure_seen = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch

        def closure():
            hidden = self.net[0](x)
            loss = F.cross_entropy(self.net[2](self.net[1](hidden)), y)
            self.closure_seen.append((hidden.dtype, hmp.casts_enabled()))
            opt.zero_grad()
            self.manual_backward(loss)
            return loss

        opt.step(closure=closure)


def test_manual_optimization_closure_runs_with_the_steps_casts():
    model = ManualWithClosure()
    trainer(HMPPrecision(), max_epochs=1).fit(model, loader())
    assert model.closure_seen and all(s == (torch.bfloat16, True) for s in model.closure_seen)
    assert model.step_casts and all(s == (False, False) for s in model.step_casts)
    assert hmp.casts_enabled() and not hmp.is_converted()


def test_bad_list_fails_when_the_plugin_is_made(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("linaer\n")
    with pytest.raises(ValueError, match="did you mean linear"):
        HMPPrecision(bf16_file_path=bad)
    with pytest.raises(ValueError):
        HMPPrecision(opt_level="O3")
    assert HMPPrecision(low_precision_type=torch.float16).precision == "16-mixed"


def test_the_plugin_takes_every_option_convert_takes(tmp_path):
    """convert()'s options are spelled once, in its signature: the plugin takes each (strict,
    uncast_file_path, fp16_file_path, ... as well as the ones it always had), refuses what convert()
    refuses, and converts with them when the run starts."""
    plugin = HMPPrecision("O1", None, None, False, strict=True, uncast_file_path="", fp16_file_path="")
    assert plugin.opt_level == "O1" and plugin.strict is True and plugin.isVerbose is False
    assert "strict=True" in repr(plugin)
    with pytest.raises(TypeError, match="unexpected keyword argument 'optlevel'"):
        HMPPrecision(optlevel="O1")
    with pytest.raises(TypeError, match="matches fp32_modules/bf16_modules against the LightningModule"):
        HMPPrecision(model=MLP())
    model = MLP()
    hmp.core.state.warned.discard(("strict",))  # the warning is once per process
    with pytest.warns(UserWarning, match="strict=True"):
        trainer(plugin, max_epochs=1).fit(model, loader())
    assert model.seen[0][0] == torch.bfloat16 and not hmp.is_converted()


def test_fp16_and_o2():
    model = MLP()
    trainer(HMPPrecision(opt_level="O2", low_precision_type=torch.float16), max_epochs=1).fit(model, loader())
    assert model.seen[0][0] == torch.float16
    assert "relu" not in model.seen[0][5]
    assert not hmp.is_converted()


def test_module_policy_by_name_in_the_plugin():
    """fp32_modules names are matched against the LightningModule's modules when the run starts."""
    model = MLP()
    seen = []
    model.net[2].register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    trainer(HMPPrecision(fp32_modules=["net.2"]), max_epochs=1).fit(model, loader())
    hidden = {s[0] for s in model.seen}
    assert hidden == {torch.bfloat16} and set(seen) == {torch.float32}  # net.0 under O1, net.2 in fp32
    assert "forward" not in vars(model.net[2]) and not hmp.is_converted()
    with pytest.raises(ValueError, match=r"fp32_modules\[0\]: 'nt\.2' matches no module"):
        trainer(HMPPrecision(fp32_modules=["nt.2"]), max_epochs=1).fit(MLP(), loader())
    assert not hmp.is_converted() and hmp.casts_enabled()


def test_fsdp_strategy_takes_hmps_fsdp_plugin():
    """Lightning's FSDPStrategy takes only an FSDPPrecision: HMPFSDPPrecision is one, with the
    policy of docs/distributed.md (FSDP gathers bf16 and reduces in float32, hmp computes the
    float32 islands); HMPPrecision stays for every other strategy."""
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp import MixedPrecision

    strategy = FSDPStrategy(precision_plugin=HMPFSDPPrecision())
    assert isinstance(strategy.precision_plugin, HMPFSDPPrecision)
    assert strategy.mixed_precision_config == MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    gather_fp32 = HMPFSDPPrecision(param_dtype=torch.float32).mixed_precision_config
    assert gather_fp32 == MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32)
    fp16 = HMPFSDPPrecision(low_precision_type=torch.float16)
    assert fp16.precision == "16-mixed" and fp16.scaler is not None  # Lightning's sharded scaler, as its own
    assert HMPFSDPPrecision().scaler is None
    with pytest.raises(TypeError, match="FSDPPrecision"):  # Lightning's own check
        FSDPStrategy(precision_plugin=HMPPrecision())
    # the hmp side is HMPPrecision's: a step casts inside forward_context, nowhere else
    plugin = HMPFSDPPrecision()
    plugin.convert()
    try:
        with plugin.forward_context():
            assert F.linear(torch.randn(2, 4), torch.randn(3, 4)).dtype == torch.bfloat16
    finally:
        plugin.revert()
    assert not hmp.is_converted()


def test_ddp_and_fsdp_with_two_devices(tmp_path):
    """Trainer(devices=2) on CPU, as a user starts it (one process; Lightning starts the other):
    strategy="ddp" with HMPPrecision, then Lightning's FSDPStrategy with HMPFSDPPrecision (on CPU
    only its wrapping is said again, with the CPU as FSDP's device: Lightning runs FSDP on GPUs only)."""
    run_ranks(tmp_path, LIGHTNING_WORKER, "ddp", "fsdp", ranks=1, timeout=240)
    for strategy in ("ddp", "fsdp"):
        runs = [torch.load(tmp_path / f"lightning_{strategy}_rank{r}.pt", weights_only=False) for r in range(2)]
        for run in runs:
            assert run["converted"] == [True] and not run["converted_after"]
            assert run["logits"] == ["torch.bfloat16"] and run["loss_dtypes"] == ["torch.float32"]
            assert run["param_dtypes"] == ["torch.float32"]
            assert run["losses"][-1] < run["losses"][0]
        # what the first layer's forward received: DDP's float32 weight, FSDP's bf16 gathered one
        assert runs[0]["weights"] == (["torch.float32"] if strategy == "ddp" else ["torch.bfloat16"])
        assert runs[0]["precision"] == ("HMPPrecision" if strategy == "ddp" else "HMPFSDPPrecision")
        if strategy == "ddp":  # replicas identical (FSDP's full state dict is rank 0's only)
            for k, v in runs[0]["state"].items():
                assert torch.equal(v, runs[1]["state"][k]), k
