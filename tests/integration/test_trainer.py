"""Hugging Face Trainer, its default (fused) optimizer, and hmp.convert()
before train(): no disable_casts() anywhere, and the run ends where fp32 does."""

import pytest
import torch
from helpers import TORCH

import hmp

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

STEPS = 60
# what every Trainer run here shares: on the CPU, nothing saved, logged, reported or drawn
QUIET_CPU = {"use_cpu": True, "report_to": [], "save_strategy": "no", "logging_strategy": "no", "disable_tqdm": True}


class Patterns(torch.utils.data.Dataset):
    """Token sequences that repeat a short random motif: learnable in a few dozen steps."""

    def __init__(self, n, length=32, vocab=64, seed=0):
        g = torch.Generator().manual_seed(seed)
        motifs = torch.randint(0, vocab, (n, 4), generator=g)
        self.ids = motifs.repeat(1, length // 4)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _train(tmp_path, converted):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=64, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    model = transformers.GPT2LMHeadModel(config)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / ("hmp" if converted else "fp32")),
        max_steps=STEPS,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        seed=0,
        dataloader_num_workers=0,
        **QUIET_CPU,
    )
    # Trainer's default with this torch: fused from torch 2.8 (transformers' rule)
    fused = TORCH >= (2, 8)
    assert args.optim == ("adamw_torch_fused" if fused else "adamw_torch")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Patterns(64))
    if converted:
        hmp.convert()
    try:
        trainer.train()
        assert bool(trainer.optimizer.defaults.get("fused")) is fused
        with torch.no_grad():
            batch = Patterns(64).ids
            out = model(input_ids=batch, labels=batch)
        logits_dtype = out.logits.dtype
        loss = out.loss.float().item()
    finally:
        hmp.revert()
    for p in model.parameters():
        assert p.dtype == torch.float32
    return loss, logits_dtype


def test_trainer_default_optimizer_under_hmp_ends_within_one_percent_of_fp32(tmp_path):
    fp32_loss, fp32_dtype = _train(tmp_path, converted=False)
    hmp_loss, hmp_dtype = _train(tmp_path, converted=True)
    assert fp32_dtype == torch.float32 and hmp_dtype == torch.bfloat16
    assert fp32_loss < 0.5 * 4.16  # it learned: ln(64) = 4.16 is chance
    assert abs(hmp_loss - fp32_loss) / fp32_loss < 0.01, (hmp_loss, fp32_loss)


def test_bf16_trainer_warning_points_at_the_users_line(tmp_path):
    """TrainingArguments(bf16=True) opens torch.autocast through accelerate and
    contextlib: hmp's warning that it casts nothing there names the line that
    called trainer.train(), not a library's."""
    import inspect
    import warnings

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), bf16=True, max_steps=1, per_device_train_batch_size=4, **QUIET_CPU
    )
    trainer = transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=Patterns(8))
    hmp.core.state.warned.discard("autocast region entered")  # the warning is once per process
    hmp.convert()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        trainer.train()
    ours = [w for w in caught if "torch.autocast region" in str(w.message)]
    assert ours, [str(w.message) for w in caught]
    assert (ours[0].filename, ours[0].lineno) == (__file__, line)
