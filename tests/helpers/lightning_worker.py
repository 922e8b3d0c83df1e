"""Lightning with devices=2 on CPU (gloo) and hmp's plugins, for tests/integration/test_lightning.py.

    python tests/helpers/lightning_worker.py OUT_DIR STRATEGY [STRATEGY ...]

Started as one process, as a user starts a script: Lightning starts the
second rank itself (it runs this script again with its rank in the
environment). Each STRATEGY (``ddp``, ``fsdp``) trains the same small
LightningModule with its own Trainer; each rank saves what it saw to
OUT_DIR/lightning_<strategy>_rank<R>.pt.
"""

import faulthandler
import os
import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

import hmp
from helpers.models import mlp
from hmp.integrations.lightning import HMPFSDPPrecision, HMPPrecision

STEPS = 4


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = mlp(16, 32, 4, act=torch.nn.GELU, seed=0)
        self.seen = {"losses": [], "logits": set(), "loss_dtypes": set(), "converted": set(), "weights": set()}
        self.net[0].register_forward_pre_hook(lambda m, a: self.seen["weights"].add(str(m.weight.dtype)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.seen["losses"].append(loss.item())
        self.seen["logits"].add(str(logits.dtype))
        self.seen["loss_dtypes"].add(str(loss.dtype))
        self.seen["converted"].add(hmp.is_converted())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 16, generator=g)
    y = (x[:, :4] * 3).argmax(dim=1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def strategy_and_plugin(name):
    if name == "ddp":
        return "ddp", HMPPrecision()
    from lightning.pytorch.strategies import FSDPStrategy

    class CPUFSDPStrategy(FSDPStrategy):
        """Lightning's FSDPStrategy on CPU, which it refuses (GPU only: its check reads the exact
        class) though FSDP runs there with gloo: only the wrapping is said again, with the CPU as
        FSDP's device (Lightning gives FSDP the GPU's index, None on CPU). The precision plugin,
        its MixedPrecision, the steps and the optimizer are Lightning's FSDP path as on a GPU."""

        def _setup_model(self, model):
            from torch.distributed.fsdp import FullyShardedDataParallel

            return FullyShardedDataParallel(
                module=model,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=torch.device("cpu"),
                **self.kwargs,
            )

    return CPUFSDPStrategy(auto_wrap_policy={torch.nn.Linear}), HMPFSDPPrecision()


def main(out_dir, *names):
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(150, exit=True)
    for name in names:
        strategy, plugin = strategy_and_plugin(name)
        model = Net()
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            plugins=[plugin],
            max_steps=STEPS,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, data())
        seen = {k: sorted(v) if isinstance(v, set) else v for k, v in model.seen.items()}
        seen["converted_after"] = hmp.is_converted()
        params = list(model.parameters())
        seen["param_dtypes"] = sorted({str(p.dtype) for p in params})
        seen["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        seen["strategy"] = type(trainer.strategy).__name__
        seen["precision"] = type(trainer.strategy.precision_plugin).__name__
        torch.save(seen, os.path.join(out_dir, f"lightning_{name}_rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:])
