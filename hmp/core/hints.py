"""Names for the types the public API takes, for its annotations."""

import os
from typing import Callable, Iterable, Optional, Union

import torch

# a list file: a path, or "" / None for the list named by the environment, else the default
ListPath = Union[str, "os.PathLike[str]", None]
# module rules: classes, instances, or name patterns matched against model.named_modules()
ModuleTargets = Optional[Iterable[Union[type, torch.nn.Module, str]]]
Step = Callable[..., object]  # a function audit, tune and profile run: it returns its loss
