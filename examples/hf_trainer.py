"""Hugging Face Trainer under hmp, on a tiny GPT-2 built from its config (nothing is downloaded).

Shows: ``hmp.convert()`` before ``trainer.train()`` is the whole integration: the
Trainer's own optimizer runs uncast, the model computes in bfloat16 where the lists say,
and its parameters stay float32.

Run:  python examples/hf_trainer.py
Needs transformers and accelerate:  pip install transformers accelerate
"""

import tempfile

import torch

try:
    import accelerate  # noqa: F401  (Trainer needs it)
    import transformers
except ImportError as error:
    raise ImportError(
        "this example needs Hugging Face transformers and accelerate: pip install transformers accelerate"
    ) from error

import hmp

VOCAB, LENGTH = 64, 32


class RepeatedMotifs(torch.utils.data.Dataset):
    """Sequences that repeat a random 4-token motif: a model learns it in a few dozen steps."""

    def __init__(self, n=64, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, 4), generator=g).repeat(1, LENGTH // 4)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class LossHistory(transformers.TrainerCallback):
    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def main():
    transformers.set_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=LENGTH, n_embd=64, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config)
    dataset = RepeatedMotifs()
    history = LossHistory()
    with tempfile.TemporaryDirectory() as output_dir:
        args = transformers.TrainingArguments(
            output_dir=output_dir,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            max_steps=60,
            per_device_train_batch_size=8,
            learning_rate=3e-3,
            lr_scheduler_type="constant",
            logging_steps=15,
            seed=0,
            disable_tqdm=True,
        )
        trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset, callbacks=[history])

        hmp.convert()
        try:
            trainer.train()
            with torch.no_grad():
                out = model(input_ids=dataset.ids[:4], labels=dataset.ids[:4])
        finally:
            hmp.revert()

    print(f"Trainer's optimizer: {getattr(args.optim, 'value', args.optim)} (it runs uncast by itself)")
    print(
        "training loss every 15 steps: "
        + ", ".join(f"{loss:.3f}" for loss in history.losses)
        + f"  (chance: ln {VOCAB} = {torch.log(torch.tensor(float(VOCAB))):.3f})"
    )
    print(f"under hmp: logits {out.logits.dtype}, loss {out.loss.dtype}")
    print(f"parameters: {sorted({str(p.dtype) for p in model.parameters()})}")
    print(f"after hmp.revert(): logits {model(input_ids=dataset.ids[:1]).logits.dtype}")


if __name__ == "__main__":
    main()
