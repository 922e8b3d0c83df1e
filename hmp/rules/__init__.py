"""How hmp stays out of the rest of PyTorch: one module per rule, each with one small
interface (interface.py: ``changes(ctx) -> Changes``, built without changing
anything), which hmp.driver.conversion installs through its undo log and revert()
undoes. What each rule keeps out and why: docs/architecture.md. RULES is their order
of installation."""

from hmp.rules import (
    buffers,
    checkpoint,
    compiled_caches,
    functions,
    no_grad_regions,
    pickling,
    refills,
    region_factories,
    regions,
    rnn,
    steps,
    uncast_calls,
    weight_writes,
)
from hmp.rules.interface import Changes, Context  # noqa: F401 (the interface, for the driver)

RULES = (
    rnn,  # RNN modules' own dtype check, where a kernel is listed
    checkpoint,  # recomputes run under their forward's hmp state
    functions,  # custom_fwd/custom_bwd Functions: the author's choice wins
    regions,  # autocast regions, backward, GradScaler, DataLoader workers: left alone
    steps,  # optimizer steps run uncast and drop the weight-cast cache
    refills,  # a write that keeps the version counter drops the weight-cast cache
    no_grad_regions,  # a no-grad region keeps its weight casts until it ends
    weight_writes,  # lower-precision values loaded into float32 weights: said once
    uncast_calls,  # building, averaging, merging, sampling: what the program keeps, uncast
    region_factories,  # an author's autocast region however a library builds it
    buffers,  # a buffer reassigned while converted keeps its dtype
    pickling,  # torch.save and multiprocessing pickle hmp's wrappers as torch's functions
    compiled_caches,  # torch.compile's caches keyed without hmp's state: off while converted
)
