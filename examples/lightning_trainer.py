"""Lightning training with hmp as the Trainer's precision plugin.

Shows: ``HMPPrecision`` (hmp.integrations.lightning) converts hmp for the run and reverts
it after; the steps compute in bfloat16 and float32 as the lists say, while the parameters,
their gradients and what ``self.log`` records stay float32.

Run:  python examples/lightning_trainer.py
Needs Lightning:  pip install lightning   (or, in a checkout of hmp: pip install ".[lightning]")
"""

import torch
import torch.nn.functional as F

try:
    import lightning.pytorch as pl
except ImportError as error:
    raise ImportError(
        'this example needs Lightning: pip install lightning  (or, in a checkout of hmp: pip install ".[lightning]")'
    ) from error

import hmp
from hmp.integrations.lightning import HMPPrecision


class Classifier(pl.LightningModule):
    def __init__(self, dim=16, classes=4):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(dim, 64), torch.nn.ReLU(), torch.nn.Linear(64, classes))
        self.first_step = None
        self.epoch_losses = []
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)  # linear, relu: BF16 list
        loss = F.cross_entropy(logits, y)  # FP32 list
        if self.first_step is None:
            self.first_step = (logits.dtype, loss.dtype, hmp.is_converted())
        self.losses.append(loss.detach())
        self.log("train_loss", loss)
        return loss

    def on_train_epoch_end(self):
        self.epoch_losses.append(torch.stack(self.losses).mean().item())
        self.losses.clear()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def data(n=512, dim=16, classes=4):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, dim, generator=g)
    y = (x @ torch.randn(dim, classes, generator=g)).argmax(dim=1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64, shuffle=True)


def main():
    pl.seed_everything(0, verbose=False)
    model = Classifier()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=4,
        plugins=[HMPPrecision(opt_level="O1")],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data())

    logits_dtype, loss_dtype, converted = model.first_step
    print(f"trainer.precision: {trainer.precision}")
    print(f"inside training_step: converted={converted}, logits {logits_dtype}, loss {loss_dtype}")
    print("mean loss per epoch: " + ", ".join(f"{loss:.4f}" for loss in model.epoch_losses))
    print(f"logged train_loss: {trainer.callback_metrics['train_loss'].dtype}")
    print(
        f"parameters: {sorted({str(p.dtype) for p in model.parameters()})}, "
        f"gradients: {sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None})}"
    )
    print(f"after fit: converted={hmp.is_converted()}")


if __name__ == "__main__":
    main()
