"""What a converted call costs a GPU's host, counted on any CPU: Python frames per call.

On a GPU at batch 1 the device waits for the host's Python, so every frame hmp runs per call is time.
The count is deterministic (``sys.setprofile``), so it gates where a timing could not: the frames
whose code lives in hmp, ``torch/autograd/function.py``, ``inspect``, ``torch/_functorch/utils.py``,
``torch/_ops.py`` or Triton, from the user's call to torch's kernel. ``meta`` tensors stand for the
device path (CUDA, HPU): the saturating cast is hmp's op there, with its gradient; the CPU path reads
the range instead. The ceilings are today's counts: a change that adds a frame per call says so here.
"""

import collections
import functools
import importlib.util
import inspect
import os

import pytest
import torch
import torch.nn.functional as F
from helpers import profiled

import hmp
from hmp.core import torch_private


def _folder(module_file):
    return os.path.dirname(os.path.abspath(module_file)) + os.sep


# hmp's frames are those of files in hmp's package directory, and torch's by torch's: never a path that only
# contains "/hmp/" (a clone named hmp holds its .venv, torch and all, under .../hmp/)
HMP, TORCH = _folder(hmp.__file__), _folder(torch.__file__)
_TRITON = importlib.util.find_spec("triton")
WATCHED_FOLDERS = (HMP,) + ((_folder(_TRITON.origin),) if _TRITON is not None and _TRITON.origin else ())
WATCHED_FILES = frozenset(
    [os.path.abspath(inspect.__file__)]
    + [os.path.join(TORCH, *p.split("/")) for p in ("autograd/function.py", "_functorch/utils.py", "_ops.py")]
)
# torch's own kernels written in Python (stock meta tensors run many: a GPU runs C++ there): frames
# they call are the kernel's, not the path to it
KERNELS = tuple(os.path.join(TORCH, p) for p in ("_prims_common/", "_refs/", "_decomp/", "_prims/"))
KERNELS += (os.path.join(TORCH, "_meta_registrations.py"),)


@functools.lru_cache(maxsize=None)
def _where(filename):
    return os.path.abspath(filename)


def watched(filename):
    """A frame's file is hmp's (in its package directory), Triton's, or one of torch's watched files."""
    where = _where(filename)
    return where in WATCHED_FILES or where.startswith(WATCHED_FOLDERS)


def _in_kernel(frame):
    frame = frame.f_back
    while frame is not None:
        if _where(frame.f_code.co_filename).startswith(KERNELS):
            return True
        frame = frame.f_back
    return False


def frames(fn):
    """Watched Python frames one call of ``fn`` runs (after two warm-up calls) on its way to torch's
    kernels, by file and function."""
    fn()
    fn()
    seen = collections.Counter()

    def profile(frame, event, arg):
        if event == "call":
            name = frame.f_code.co_filename
            if watched(name) and not _in_kernel(frame):
                seen[f"{name.rsplit('/', 1)[-1]}:{frame.f_code.co_name}"] += 1

    with profiled(profile):
        fn()
    return seen


def _leaf(*shape, device):
    return torch.randn(*shape, device=device, requires_grad=True)


def _activation(*shape, device):
    return _leaf(*shape, device=device) * 1.0  # a non-leaf that requires grad


# name -> (device, grad mode, a builder of the call, ceiling): the forms a model calls
def _cases():
    def linear(device):
        a, w = _activation(8, 64, device=device), _leaf(64, 64, device=device)
        return lambda: F.linear(a, w)

    def linear_bias_keyword(device):
        a, w, b = _activation(8, 64, device=device), _leaf(64, 64, device=device), _leaf(64, device=device)
        return lambda: F.linear(a, w, bias=b)

    def mm(device):
        a, w = _activation(8, 64, device=device), _leaf(64, 64, device=device)
        return lambda: torch.mm(a, w)

    def matmul(device):
        a, w = _activation(8, 64, device=device), _leaf(64, 64, device=device)
        return lambda: a @ w

    def bmm(device):
        a, b = _activation(2, 8, 16, device=device), _activation(2, 16, 8, device=device)
        return lambda: torch.bmm(a, b)

    def conv(device):
        x, w = _activation(1, 3, 8, 8, device=device), _leaf(4, 3, 3, 3, device=device)
        return lambda: F.conv2d(x, w)

    def inplace(device):  # a listed op written in place: the in-place rule (the written tensor's dtype)
        c = torch.randn(8, 64, device=device)
        a, b = torch.randn(8, 64, device=device), torch.randn(64, 64, device=device)
        return lambda: c.addmm_(a, b)

    def out(device):  # a listed op given out=: the in-place rule
        c = torch.empty(8, 64, device=device)
        a, b = torch.randn(8, 64, device=device), torch.randn(64, 64, device=device)
        return lambda: torch.mm(a, b, out=c)

    def fp32_list(device):  # an FP32-list op given a bf16 activation: cast up
        x = torch.randn(8, 64, device=device).bfloat16()
        labels = torch.zeros(8, dtype=torch.long, device=device)
        return lambda: F.cross_entropy(x, labels)

    def fp32_keyword(device):  # an FP32-list op given a keyword (F.kl_div passes log_target so): one scan
        x, t = torch.randn(4, 5, device=device).bfloat16(), torch.randn(4, 5, device=device)
        return lambda: torch.kl_div(x, t, 2, log_target=False)

    def promote(device):  # a promote-list op hmp wraps (its kernel takes one dtype), given two
        x = torch.zeros(8, 64, device=device)
        index = torch.arange(8, device=device)
        y = torch.randn(8, 64, device=device, dtype=torch.bfloat16)
        return lambda: torch.index_add(x, 0, index, y)

    return {
        # the training case: activation and trainable weight; off the CPU (meta) and on it
        "linear, meta, grad": ("meta", True, linear, 14),
        "linear, meta, no_grad": ("meta", False, linear, 7),
        "linear, cpu, grad": ("cpu", True, linear, 10),
        # a keyword call runs the site's rule: one frame more than the positional call, no question per tensor
        "linear bias=, meta, grad": ("meta", True, linear_bias_keyword, 20),
        "mm, meta, grad": ("meta", True, mm, 14),
        "matmul, meta, grad": ("meta", True, matmul, 14),
        "bmm, meta, grad": ("meta", True, bmm, 10),
        "conv2d, meta, grad": ("meta", True, conv, 14),
        "addmm_ in place, cpu": ("cpu", True, inplace, 4),
        "mm out=, cpu": ("cpu", True, out, 8),
        "cross_entropy (FP32 list), cpu": ("cpu", True, fp32_list, 5),
        "kl_div log_target= (FP32 list, keyword), cpu": ("cpu", True, fp32_keyword, 5),
        "index_add (promote list), cpu": ("cpu", True, promote, 10),
    }


CASES = _cases()


@pytest.mark.parametrize("name", list(CASES))
def test_a_converted_call_runs_few_python_frames(hmp_converted, name):
    device, grad, build, ceiling = CASES[name]
    ceiling += 0 if torch_private.KNOWS_COMPILE_SESSION else 1  # before 2.13 the call's state costs a frame more
    call = build(device)
    with torch.set_grad_enabled(grad):
        seen = frames(call)
    total = sum(seen.values())
    assert total <= ceiling, (total, dict(seen))
    assert not [f for f in seen if f.startswith("inspect.py")], dict(seen)  # no signature bound per call


def test_hmps_frames_are_told_by_its_package_directory_not_a_path_that_contains_hmp():
    """A clone named ``hmp`` keeps README's .venv, torch and all, under ``.../hmp/``: none of it is hmp's."""
    clone = os.path.join(os.sep, "work", "hmp")
    assert watched(hmp.__file__) and watched(os.path.join(HMP, "core", "wrap.py"))
    assert watched(os.path.join(TORCH, "_ops.py")) and watched(inspect.__file__)
    for other in (".venv/lib/python3/site-packages/torch/nn/functional.py", "hmp_extra/hmp/x.py", "tests/x.py"):
        assert not watched(os.path.join(clone, *other.split("/"))), other
    assert not watched(os.path.join(TORCH, "nn", "functional.py"))


def test_the_frames_counted_are_hmps_and_a_plain_call_runs_none(hmp_converted):
    """The counter sees hmp's frames (a converted linear runs some), and a call hmp does not wrap runs none."""
    a, w = _activation(8, 64, device="meta"), _leaf(64, 64, device="meta")
    assert sum(frames(lambda: F.linear(a, w)).values()) > 0
    assert sum(frames(lambda: torch.relu(a)).values()) == 0  # a pointwise op is torch's own object
    hmp.revert()
    assert sum(frames(lambda: F.linear(a, w)).values()) == 0


def test_an_eager_call_asks_what_it_runs_under_without_a_frame_of_hmps(hmp_converted):
    """What a wrapper call runs under (compiled, traced, eager) is asked inline: dynamo's folded
    question, then, where torch holds a flag for a whole compile session, two C calls; hmp's
    after_dynamo() runs only where something compiles or traces."""
    if not torch_private.KNOWS_COMPILE_SESSION:
        pytest.skip(f"torch {torch.__version__}: a compile session shows only in after_dynamo(), asked per call")
    a, w = _activation(8, 64, device="meta"), _leaf(64, 64, device="meta")
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            seen = frames(lambda: F.linear(a, w))
        assert seen["wrap.py:wrapper"] == 1 and not [f for f in seen if f.startswith("torch_private.py")], dict(seen)


def test_a_differentiable_cast_binds_no_signature(hmp_converted):
    """The saturating cast's autograd Function is applied through torch's C apply: ``inspect`` never
    runs, and neither does Function.apply's Python, in grad mode on the device path."""
    a, w = _activation(8, 64, device="meta"), _leaf(64, 64, device="meta")
    seen = frames(lambda: F.linear(a, w))
    assert not [f for f in seen if f.startswith(("inspect.py", "function.py", "utils.py"))], dict(seen)
    out = F.linear(a, w)
    assert out.dtype == torch.bfloat16 and out.grad_fn is not None


def test_frozen_weights_costs_a_decode_token_no_more_frames_than_without_it(hmp_converted):
    """hmp inside ``frozen_weights()`` is never slower than hmp without it: per decode token of a
    small Llama under no_grad (generate()'s region), it runs no more of hmp's frames."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="eager",
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.zeros(1, 1, dtype=torch.long, device="meta")

    def token():
        with torch.no_grad():
            return model(ids).logits

    try:
        plain = sum(frames(token).values())
    except RuntimeError as e:  # torch < 2.5 refuses autocast(device_type="meta"), which the rotary embedding enters
        pytest.skip(f"this torch runs no Llama on meta tensors: {e}")
    with hmp.frozen_weights():
        frozen = sum(frames(token).values())
    assert 0 < frozen <= plain, (frozen, plain)


def _python_functions_calling_a_wrapped_builtin():
    """(Python function, the builtin it calls by name) for every listed op's pair of sites: found
    from the functions' code, not named here."""
    import types

    from hmp.binding.resolve import Resolver

    resolver, pairs = Resolver(), []
    for names in hmp.effective_lists().values():
        for name in sorted(names):
            found = [(s, hmp.core.identity.unwrap(s.original())) for s in resolver.sites(name)]
            builtins = [(s, fn) for s, fn in found if isinstance(fn, types.BuiltinFunctionType)]
            for s, fn in found:
                if isinstance(fn, types.FunctionType):
                    scope, names_used = fn.__globals__, fn.__code__.co_names
                    pairs += [
                        (s, b)
                        for b, _ in builtins
                        if b.attr in names_used and any(scope.get(g) is b.namespace for g in names_used)
                    ]
    return pairs


def test_an_op_listed_under_two_names_is_wrapped_once(hmp_converted):
    """``F.kl_div`` calls ``torch.kl_div``: one wrapper (the builtin's) decides its calls, so the
    Python function stays torch's own object and costs no hmp frame of its own; a call through it
    still follows the list."""
    pairs = _python_functions_calling_a_wrapped_builtin()
    assert len(pairs) >= 5  # F.kl_div, F.embedding, F.ctc_loss, ... under the default lists
    for python, builtin in pairs:
        assert getattr(python.namespace, python.attr) is python.original(), python.label  # not replaced
        assert getattr(builtin.namespace, builtin.attr) is not builtin.original(), builtin.label  # wrapped
    x, t = torch.randn(4, 5, dtype=torch.bfloat16).log_softmax(-1), torch.randn(4, 5).softmax(-1)
    assert F.kl_div(x, t, reduction="sum").dtype == torch.float32  # FP32 list, through torch.kl_div
    through_f = frames(lambda: F.kl_div(x, t, reduction="sum"))
    direct = frames(lambda: torch.kl_div(x, t, 2, log_target=False))  # as F.kl_div calls it
    assert sum(through_f.values()) == sum(direct.values()) > 0, (through_f, direct)
