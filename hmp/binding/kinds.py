"""The list kinds: one record per list (``Kind``), read by everything that treats a list
by its kind, and ``kind(name)``, which raises for an unknown name.

A record gives a list's public name (the key of ``effective_lists()`` and its file
parameter), where its file comes from, and what hmp does with an entry: the policy
factory's name, the lean path's casts (``Lean``), the module rule and which entries
are bound (pays.py). It names the call path and imports none of it: sites.py builds
the wrapper. A new kind is one record, its policy, its list file and its parameter.

The lower list keeps Habana's public name "bf16"; it runs in float16 too, so inside
hmp it is ``LOWER``."""

from dataclasses import dataclass, field
from typing import Callable, Mapping, NamedTuple, Optional

import torch

from hmp.binding import pays
from hmp.core import dtypes


class Fallback(NamedTuple):
    """An op in no list that gets this kind's rule only where it must
    (lists.fallback_names), each a name in hmp/core/policy.py: ``needs(args,
    kwargs)`` says when a call must step in; ``policy`` replaces the kind's
    own (None: the kind's own); ``retry``: the factory that puts every
    floating argument in one dtype where the kernel rejects the mix (None: no
    retry)."""

    needs: str
    policy: Optional[str] = None
    retry: Optional[str] = None


class Lean(NamedTuple):
    """The lean path's casts (a call without keywords skips the site's
    prepare, hmp/binding/sites.py): tensors of a dtype in ``src`` are cast to
    ``to`` (None: the lower dtype in use); ``numbers``: a Python number the
    lower dtype cannot hold sends the call to the full rule. ``one_dtype``:
    the promote rule's common case instead, a call whose floating tensors
    share one dtype runs as given."""

    src: frozenset = frozenset()
    to: Optional[torch.dtype] = None
    numbers: bool = False
    one_dtype: bool = False


@dataclass(frozen=True, eq=False)
class Kind:
    """One list kind, as users, files and every module of hmp see it."""

    name: str  # public: effective_lists()'s key, @hmp.<name>_function, register()'s kind
    title: str  # the list in messages, where its dtype is not known
    file_title: str  # its file in messages
    parameter: str  # convert()'s parameter naming its file
    defaults: Mapping[str, str]  # opt_level -> the shipped file of its default list
    policy: str  # policy.py's factory (low, casters, out=None) -> prepare: what a call of this kind casts
    lean: Lean  # the lean path's casts
    environ: tuple = ()  # variables naming its file when convert() gets none, in order of precedence
    dtype_titles: Mapping = field(default_factory=dict)  # lower dtype in use -> the list's title
    own_under: tuple = ()  # opt_levels whose own list replaces a file given for this kind (with a warning)
    o1_defaults: Mapping = field(default_factory=dict)  # "fp16" / "strict" -> the O1 default in that mode
    module_rule: Optional[str] = None  # modules.Forwards' method for a module entry; None: entries are an error
    modules_parameter: Optional[str] = None  # convert()'s parameter naming module entries of this kind
    module_says: str = ""  # the module rule, in effective_lists(detail=True)
    norms: Optional[str] = None  # policy.py's factory for a normalisation entry (its input alone is cast)
    fallback: Optional[Fallback] = None  # the rule an op in no list gets through this kind
    unbound: Optional[Callable] = None  # (name, one_dtype) -> why an entry is not bound outside strict mode, or None
    # a user file that leaves out entries of the default list is warned about: the FP32 list keeps losses
    # and softmax out of the lower dtype, the promote list gives mixed inputs one dtype; a lower list
    # file that leaves some out only runs them in float32
    guards_defaults: bool = True

    def title_in(self, low=None):
        """The list's name in messages, by the lower dtype in use where known."""
        return self.dtype_titles.get(low, self.title)

    def default_file(self, opt_level, low=torch.bfloat16, strict=False):
        """The shipped file of this kind's default list."""
        if opt_level == "O1":
            if low == torch.float16 and "fp16" in self.o1_defaults:
                return self.o1_defaults["fp16"]
            if strict and "strict" in self.o1_defaults:
                return self.o1_defaults["strict"]
        return self.defaults[opt_level]

    @property
    def takes_modules(self):
        return self.module_rule is not None


LOWER = Kind(
    name="bf16",
    title="lower-precision",
    file_title="BF16 list file",
    parameter="bf16_file_path",
    defaults={"O1": "bf16.txt", "O2": "o2_bf16.txt"},
    policy="lower",
    lean=Lean(dtypes.FP32_ONLY, numbers=True),
    # the names Lightning's HPU docs use, then the names Habana's autocast reads
    environ=("LOWER_LIST", "PT_HPU_AUTOCAST_LOWER_PRECISION_OPS_LIST"),
    dtype_titles={torch.bfloat16: "BF16", torch.float16: "FP16"},
    own_under=("O2",),
    # float16 overflows above 65504: its O1 lower list is the GEMM/convolution family, as torch.autocast's
    # and apex O1's float16 lists (the seed's BF16 list stays available: ``include bf16``); strict=True:
    # Habana's BF16 list, which also names the entries that cast only in strict mode (hmp/binding/pays.py)
    o1_defaults={"fp16": "fp16.txt", "strict": "bf16_strict.txt"},
    module_rule="in_lower",
    modules_parameter="bf16_modules",
    module_says="the whole forward in the lower dtype",
    norms="lower_input_only",
    unbound=pays.unless_it_pays,
    guards_defaults=False,
)

FP32 = Kind(
    name="fp32",
    title="FP32",
    file_title="FP32 list file",
    parameter="fp32_file_path",
    defaults={"O1": "fp32.txt", "O2": "o2_fp32.txt"},
    policy="fp32",
    lean=Lean(dtypes.HALVES, dtypes.FP32),
    environ=("FP32_LIST", "PT_HPU_AUTOCAST_FP32_OPS_LIST"),
    own_under=("O2",),
    module_rule="in_float32",
    modules_parameter="fp32_modules",
    module_says="the whole forward in float32",
    fallback=Fallback("given_lower"),
)

PROMOTE = Kind(
    name="promote",
    title="promote",
    file_title="promote list file",
    parameter="promote_file_path",
    defaults={"O1": "promote.txt", "O2": "promote.txt"},
    policy="promote",
    lean=Lean(one_dtype=True),
    fallback=Fallback("given_mixed", "as_given", "promote"),
    unbound=pays.unless_one_dtype,
)

KINDS = (LOWER, FP32, PROMOTE)  # every list, in the order lists are read and shown
OPT_LEVELS = ("O1", "O2")


def names():
    """The public names of the kinds, in order."""
    return tuple(k.name for k in KINDS)


def kind(name):
    """The record of list kind ``name`` (a record passes through); a
    ValueError naming the kinds for anything else: no kind falls through
    to another's rule."""
    if isinstance(name, Kind):
        return name
    for k in KINDS:
        if k.name == name:
            return k
    raise ValueError(f"hmp: unknown list kind {name!r}; the kinds are {', '.join(names())}")
