"""The precision configurations the harness compares.

Each configuration says how a model is prepared (dtype), what is active
while it runs (hmp converted or not), what wraps forward+loss (autocast)
and what wraps the optimizer step (hmp.disable_casts). Activation
(hmp.convert / hmp.revert) is done by the caller outside the timed region.
"""

import contextlib
from dataclasses import dataclass, field

import floor
import torch
from autocast_lists import list_paths

import hmp


@dataclass(frozen=True)
class Config:
    name: str
    label: str
    kind: str  # "fp32" | "autocast" | "hmp" | "bf16" | "floor" (benchmarks/floor.py: the bound for a Python wrapper)
    hmp_args: dict = field(default_factory=dict)
    frozen: bool = False  # the whole run inside hmp.frozen_weights() (weights unchanged: inference)
    accumulate: bool = False  # the whole run inside hmp.accumulation() (a weight cast once per optimizer step)

    @property
    def is_hmp(self):
        return self.kind == "hmp"

    @property
    def model_dtype(self):
        return torch.bfloat16 if self.kind == "bf16" else torch.float32

    @contextlib.contextmanager
    def active(self):
        """hmp converted for the block (the floor's wrappers installed; a no-op for the other kinds)."""
        if self.kind == "floor":
            with floor.installed(**self.hmp_args):
                yield
            return
        if not self.is_hmp:
            yield
            return
        with contextlib.ExitStack() as stack:
            stack.enter_context(hmp.converted(**self.hmp_args))
            if self.frozen:
                stack.enter_context(hmp.frozen_weights())
            if self.accumulate:
                stack.enter_context(hmp.accumulation())
            yield

    def forward_ctx(self, device):
        if self.kind == "autocast":
            return torch.autocast(device, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def optimizer_ctx(self):
        return hmp.disable_casts() if self.is_hmp else contextlib.nullcontext()


def autocast_list_args(device):
    paths = list_paths("cuda" if device == "cuda" else "cpu")
    return {
        "bf16_file_path": str(paths["bf16"]),
        "fp32_file_path": str(paths["fp32"]),
        "promote_file_path": str(paths["promote"]),
    }


def all_configs(device):
    return [
        Config("fp32", "fp32", "fp32"),
        Config("autocast", "torch.autocast bf16", "autocast"),
        Config("hmp-O1", "hmp O1 (default lists)", "hmp", {"opt_level": "O1"}),
        Config("hmp-O1-ac", "hmp O1 (autocast's lists)", "hmp", dict(opt_level="O1", **autocast_list_args(device))),
        Config("hmp-O2", "hmp O2", "hmp", {"opt_level": "O2"}),
        Config("hmp-O1-frozen", "hmp O1 inside hmp.frozen_weights()", "hmp", {"opt_level": "O1"}, frozen=True),
        Config("hmp-O1-acc", "hmp O1 inside hmp.accumulation()", "hmp", {"opt_level": "O1"}, accumulate=True),
        Config("floor", "the floor: the smallest Python wrapper with hmp O1's casts", "floor", {"opt_level": "O1"}),
        Config("bf16", "pure bf16 (model.bfloat16())", "bf16"),
    ]


def select(configs, names):
    if not names:
        return configs
    by_name = {c.name: c for c in configs}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown config(s) {unknown}; choose from {list(by_name)}")
    return [by_name[n] for n in names]
