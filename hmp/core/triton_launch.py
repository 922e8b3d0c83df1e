"""The saturating cast's Triton kernel launched without Triton's JIT after its first launch.

``kernel[grid](...)`` binds arguments, builds a cache key and reads the current device
on every launch, which costs a GPU host more than the kernel. ``Launcher`` launches
through the JIT once per specialisation, keeps the compiled kernel and then calls its
launcher itself with the arguments Triton's ``JITFunction.run`` gives it::

    compiled.run(grid0, grid1, grid2, stream, compiled.function, compiled.packed_metadata,
                 launch_metadata, launch_enter_hook, launch_exit_hook, *kernel_args)

``kernel_args``: the non-constexpr arguments on Triton 3.0 to 3.2, every argument from
3.3, as the compiled kernel's signature says. Other releases, other backends, the
interpreter or a failed direct launch: the JIT, for good. Triton's launcher is reached
from this module only.

The layout was read from Triton's source, and a launcher given the wrong arguments may
still run and write wrong bits. So each specialisation's first direct launch runs on the
input the JIT just cast, into a scratch tensor, and must give the JIT's bits; any other
bits turn the JIT on for good, with one warning. Once per specialisation, never while a
CUDA graph is captured (a comparison reads the device): the next launch outside one checks."""

import importlib
import re
import warnings

import torch

from hmp.core.state import user_stacklevel

# releases whose JIT launches as above: read in 3.0, 3.6 and 3.9's source, 3.2 to 3.4 in copies of their
# JITFunction.run; the releases between launch alike (a launcher given other arguments raises: the JIT's then)
FIRST, LAST = (3, 0), (3, 9)
ALL_ARGS = (3, 3)  # from here the JIT passes the constexprs to the launcher too
_I32 = 2**31 - 1  # a larger int is an i64 argument to Triton: another compiled kernel


def release(version):
    """``(major, minor)`` of a Triton version string, None where it does not read as one."""
    found = re.match(r"(\d+)\.(\d+)", str(version))
    return (int(found[1]), int(found[2])) if found else None


def _capturing():
    """Whether the current CUDA stream is being captured into a graph (False without CUDA)."""
    try:
        return torch.cuda.is_current_stream_capturing()
    except (AssertionError, RuntimeError, AttributeError):  # a build without CUDA
        return False


def _active(hook):
    # a launch hook in force: a function, or (3.6 on) a HookChain with calls in it
    return hook is not None and bool(getattr(hook, "calls", True))


class Launcher:
    """``launcher(src, dst, n, top, bf16)``: one launch of ``jit`` over ``n`` elements. A
    compiled kernel is kept per dtype, device and what Triton specialises on, so a call
    gets the kernel Triton would pick; with launch or pre-run hooks in force the call goes
    through the JIT."""

    def __init__(self, triton, jit, block, driver=None, capturing=None):
        self.jit, self.block = jit, block
        self.capturing = capturing or _capturing
        self.version = getattr(triton, "__version__", "")
        found = release(self.version)
        self.direct = found is not None and FIRST <= found <= LAST  # False for good once a try fails
        self.all_args = found is not None and found >= ALL_ARGS
        knobs = getattr(triton, "knobs", None)
        self.hooks = getattr(knobs, "runtime", None)  # 3.4 on; before: the CompiledKernel class
        self.pre_run = getattr(jit, "pre_run_hooks", ())
        self.driver = driver
        self.kernels = {}  # (bf16, device, specialisation) -> the direct launch

    def __call__(self, src, dst, n, top, bf16):
        grid = -(-n // self.block)
        if self.direct:
            src_16, dst_16 = src.data_ptr() % 16 == 0, dst.data_ptr() % 16 == 0
            key = (bf16, src.get_device(), src_16, dst_16, n % 16 == 0, n == 1, n > _I32)
            direct = self.kernels.get(key)
            hooks = self.hooks
            if direct is not None and not (
                _active(hooks.launch_enter_hook) or _active(hooks.launch_exit_hook) or self.pre_run
            ):
                try:
                    direct(grid, src, dst, n, top, bf16)
                    return
                except Exception:  # a launcher this release calls otherwise: the JIT's launch from now on
                    self.direct = False
        compiled = self.jit[(grid,)](src, dst, n, top, BLOCK=self.block, BF16=bf16)
        if self.direct and key not in self.kernels and not self.capturing():
            direct = self._direct(compiled, key[1])
            if direct is None or not self._agrees(direct, (grid, src, dst, n, top, bf16)):
                self.direct = False
            else:
                self.kernels[key] = direct

    def _agrees(self, direct, launch):
        """Whether ``direct`` gives the bits the JIT's launch just wrote into ``dst``, on the same
        input, into a tensor of ``dst``'s layout holding none of them; if not, says so once."""
        grid, src, dst, n, top, bf16 = launch
        out = dst.view(torch.int16).bitwise_not().view(dst.dtype)  # no bit right: a launch that writes nothing fails
        try:
            direct(grid, src, out, n, top, bf16)
        except Exception:  # a launcher this release calls otherwise: the JIT's launch, as below
            return False
        if torch.equal(out.view(torch.int16), dst.view(torch.int16)):
            return True
        warnings.warn(
            f"hmp: the saturating cast's direct launch of its Triton kernel gave other bits than Triton's "
            f"own launch on the same input (Triton {self.version}): hmp launches it through Triton's JIT "
            f"from now on (correct, a few microseconds more per cast). Please report it with your Triton "
            f"version (hmp/core/triton_launch.py).",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )
        return False

    def _direct(self, compiled, device):
        """The direct launch of ``compiled`` on ``device``, or None where this release, backend or
        kernel is not the one the argument layout was read from."""
        try:
            run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
            count = len(compiled.src.signature)
            backend = compiled.metadata.target.backend
        except Exception:  # the interpreter returns None; another release names these otherwise
            return None
        hooks = self.hooks if self.hooks is not None else type(compiled)
        if not (hasattr(hooks, "launch_enter_hook") and hasattr(hooks, "launch_exit_hook")):
            return None
        if backend != "cuda" or function is None or count != (6 if self.all_args else 4):
            return None
        driver = self.driver or importlib.import_module("triton.runtime.driver").driver
        stream = driver.active.get_current_stream  # torch's current raw stream of a device
        self.hooks, block = hooks, self.block

        if self.all_args:

            def direct(grid, src, dst, n, top, bf16):
                run(grid, 1, 1, stream(device), function, packed, None, None, None, src, dst, n, top, block, bf16)

        else:

            def direct(grid, src, dst, n, top, bf16):
                run(grid, 1, 1, stream(device), function, packed, None, None, None, src, dst, n, top)

        return direct
