"""The demo's data: Python source from the running interpreter's standard
library, as character ids. Nothing is downloaded.

The choice is deterministic for a given interpreter: the public top-level
modules (``*.py`` not starting with ``_``) sorted by name; every tenth file
goes to validation, the rest to training, each split filled in that order up
to a fixed character budget. Characters are ASCII codes 0-126; anything else
(non-ASCII letters in docstrings, DEL) becomes one shared id, 127.
"""

import re
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import torch

VOCAB = 128
OTHER = VOCAB - 1  # every character outside ASCII 0-126
TRAIN_CHARS = 1_500_000
VAL_CHARS = 150_000
_NOT_ASCII = re.compile(r"[^\x00-\x7e]")


class DataError(RuntimeError):
    """The standard library sources cannot be found or read."""


@dataclass
class Corpus:
    train: torch.Tensor  # int64 character ids
    val: torch.Tensor
    root: Path
    train_files: list = field(default_factory=list)
    val_files: list = field(default_factory=list)

    def unigram_baseline(self):
        """Cross-entropy (nats/char) on validation of the best model that
        ignores context: training-set character frequencies, add-one smoothed."""
        counts = torch.bincount(self.train, minlength=VOCAB).double() + 1.0
        logp = (counts / counts.sum()).log()
        return float(-logp[self.val].mean())


def stdlib_dir():
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root=None):
    """Public top-level modules of the stdlib, sorted by file name."""
    root = Path(root) if root is not None else stdlib_dir()
    files = sorted((p for p in root.glob("*.py") if not p.name.startswith("_") and p.is_file()), key=lambda p: p.name)
    if not files:
        raise DataError(
            f"no standard library source files (*.py) found in {str(root)!r}; "
            "this Python install ships without its .py sources"
        )
    return files


def encode(text):
    """Text to a 1-D int64 tensor of character ids (see module docstring)."""
    data = _NOT_ASCII.sub("\x7f", text).encode("ascii")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def decode(ids):
    return "".join(chr(i) if i != OTHER else "?" for i in ids.tolist())


def load(train_chars=TRAIN_CHARS, val_chars=VAL_CHARS, root=None, val_every=10):
    """Read the stdlib sources into a Corpus (train and validation ids)."""
    files = stdlib_files(root)
    parts = {"train": [], "val": []}
    names = {"train": [], "val": []}
    budget = {"train": train_chars, "val": val_chars}
    for i, path in enumerate(files):
        split = "val" if i % val_every == val_every - 1 else "train"
        if budget[split] <= 0:
            if budget["train"] <= 0 and budget["val"] <= 0:
                break
            continue
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise DataError(f"cannot read {str(path)!r}: {e.strerror}") from None
        text = text[: budget[split]]
        budget[split] -= len(text) + 1
        parts[split].append(text + "\n")
        names[split].append(path.name)
    for split in ("train", "val"):
        if not parts[split]:
            raise DataError(f"not enough standard library source in {str(files[0].parent)!r} for a {split} split")
    root = files[0].parent
    return Corpus(encode("".join(parts["train"])), encode("".join(parts["val"])), root, names["train"], names["val"])


def batches(data, batch_size, seq_len, generator):
    """An endless iterator of (inputs, targets), random windows of ``data``."""
    high = data.numel() - seq_len - 1
    offsets = torch.arange(seq_len + 1)
    while True:
        starts = torch.randint(0, high, (batch_size,), generator=generator)
        window = data[starts[:, None] + offsets]
        yield window[:, :-1], window[:, 1:]


def eval_windows(data, count, seq_len):
    """``count`` fixed windows spread evenly over ``data``: (inputs, targets)."""
    high = data.numel() - seq_len - 1
    count = max(1, min(count, high))
    starts = torch.linspace(0, high, count).long()
    window = data[starts[:, None] + torch.arange(seq_len + 1)]
    return window[:, :-1], window[:, 1:]
