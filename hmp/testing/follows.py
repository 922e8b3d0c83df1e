"""One call against hmp's rules: run it under the conversion in force, and
compare what ran (recorded: what the op received, what it returned) with
what the rules say (``expected_call``) and with plain torch (hmp's casts
off) where the rules leave the call to torch."""

import re
from typing import NamedTuple, Optional

import torch

from hmp.core import dtypes, torch_private
from hmp.core.dtypes import FLOATS
from hmp.core.switches import disable_casts
from hmp.driver.queries import in_force
from hmp.testing.oracle import Expected, expected_call, rule_of
from hmp.testing.recording import record_ops

_NO_KERNEL = re.compile(torch_private.NO_KERNEL_MESSAGE)


class Rejected(Exception):
    """torch rejects the call, with hmp's casts and without them: not a rule's doing."""


class Followed(NamedTuple):
    expected: Expected
    result: object  # what the call returned under hmp
    dtype: Optional[torch.dtype]  # its floating result's


def _copies(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_copies(v) for v in value)
    if isinstance(value, dict):
        return {k: _copies(v) for k, v in value.items()}
    return value


def first_floating(result):
    """The dtype of the first floating tensor in ``result`` (at any depth of tuples and lists), or None."""
    if isinstance(result, torch.Tensor):
        return result.dtype if result.dtype in FLOATS else None
    if isinstance(result, (list, tuple)):
        return next((d for d in map(first_floating, result) if d is not None), None)
    return None


def _tensors(args, kwargs):
    out = []

    def visit(v):
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif type(v) is list or type(v) is tuple:
            for x in v:
                visit(x)

    visit(tuple(args))
    visit(tuple(kwargs.values()))
    return out


def _name(dtype):
    return dtypes.name(dtype) if dtype is not None else "no floating dtype"


def _lost_finite(given, at):
    """A line when a finite value of a tensor the call was given reached the
    op (``at``, a Ran or None) as inf or NaN (in a copy hmp cast), else None."""
    received = at.received if at is not None else ()
    if len(received) != len(given):
        return None
    for i, (g, r) in enumerate(zip(given, received)):
        if r is g or g.dtype not in FLOATS or r.shape != g.shape:
            continue
        lost = torch.isfinite(g) & ~torch.isfinite(r)
        if lost.any():
            value, became = g[lost].reshape(-1)[0].item(), r[lost].reshape(-1)[0].item()
            return f"tensor argument {i}: the finite value {value!r} reached the op as {became!r}"
    return None


def _failed(error, low):
    said = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    if _NO_KERNEL.search(str(error)):
        return (
            f"no {dtypes.name(low)} kernel for the cast its list asks for: it fails ({said}), and hmp does not "
            "run it as given; take it out of that list"
        )
    return f"fails under hmp, runs in plain torch: {said}"


def _recorded(op, args, kwargs):
    """``(the tensors given, [Ran], (args, kwargs))`` of the call run again on
    copies (those arguments), recorded (the random stream put back): a second
    run, since hmp reads where an error came from off its traceback, which
    the recorder's frame would hide (an op hmp runs as given for want of a
    kernel); ``[]`` where it raises."""
    args, kwargs = _copies(args), _copies(kwargs)
    given = _tensors(args, kwargs)
    try:
        with torch.random.fork_rng(devices=[]), record_ops() as ran:
            op(*args, **kwargs)
    except Exception:
        return given, [], (args, kwargs)
    return given, ran, (args, kwargs)


def _same(received, given):
    return len(received) == len(given) and all(r is g for r, g in zip(received, given))


def _converted_at(ran, given, op, args, kwargs):
    """The recorded call where the conversion of ``op(*args, **kwargs)``
    takes effect, what "the op received" means (a Ran; None when nothing was
    recorded): the outermost recorded call, unless it received the very
    tensors it was given and is a torch function written in Python (its
    ``inner`` holds the calls its body made): then no conversion took effect
    at its own call, and the op received what the first call its body made
    that the same rule binds received (``F.pad``: ``torch._C._nn.pad``),
    among the calls on the program's tensors (on the given tensors' devices:
    a conversion changes dtypes, not devices). The outermost call where no
    call of its body is bound by that rule."""
    if not ran:
        return None
    first = ran[0]
    if not first.inner or not _same(first.received, given):
        return first
    bound, devices = rule_of(op, *args, **kwargs), {t.device for t in given}
    if bound is None:
        return first
    for call in first.inner:
        if not call.received or not {t.device for t in call.received} <= devices:
            continue
        try:
            if rule_of(call.fn, *call.args, **(call.kwargs or {})) == bound:
                return call
        except Exception:  # a call the oracle cannot bind on these arguments is not the rule's
            continue
    return first


def follow(op, /, *args, **kwargs):
    """Run ``op(*args, **kwargs)`` under the conversion in force and check it
    against hmp's rules: it does not fail where plain torch runs it; its
    floating result has the dtype the rules give (torch's own, where they
    leave the call to torch); the op received its floating tensors in the
    dtypes the rules give; no finite value reached it as inf or NaN. Returns
    a Followed; raises AssertionError naming the rule broken, and Rejected
    when torch rejects the call with and without hmp."""
    try:
        with disable_casts():
            plain, plain_error = op(*_copies(args), **_copies(kwargs)), None
    except Exception as e:
        plain, plain_error = None, e
    try:
        expected = expected_call(op, *args, **kwargs)
    except Exception as e:
        expected = e
    try:
        result = op(*args, **kwargs)
    except Exception as e:
        if plain_error is None:
            conversion = in_force()
            raise AssertionError(
                _failed(e, conversion.options.low_precision_type if conversion else torch.bfloat16)
            ) from None
        raise Rejected(f"torch rejects this call with and without hmp: {type(e).__name__}: {e}") from e
    if isinstance(expected, Exception):
        raise AssertionError(f"it ran, where hmp's rules say it raises: {type(expected).__name__}: {expected}")
    if expected.left_to_torch and plain_error is not None:
        raise AssertionError(f"it ran under hmp, where the rules leave it to torch and torch raises: {plain_error}")
    want = first_floating(plain) if expected.left_to_torch else expected.dtype
    have = first_floating(result)
    if have != want:
        raise AssertionError(f"it ran in {_name(have)}, the rules say {_name(want)} ({expected.rule})")
    given, ran, called = _recorded(op, args, kwargs)
    at = _converted_at(ran, given, op, *called)
    if not expected.left_to_torch and at is not None and at.inputs != expected.received:
        got, said = ", ".join(map(_name, at.inputs)), ", ".join(map(_name, expected.received))
        raise AssertionError(f"the op received ({got}), the rules say ({said}) ({expected.rule})")
    lost = _lost_finite(given, at)
    if lost:
        raise AssertionError(f"a finite value became inf or NaN in hmp's cast: {lost}")
    return Followed(expected, result, have)


def assert_follows_rules(op, /, *args, **kwargs):
    """``follow``, for a test: returns the call's result under hmp; raises
    AssertionError naming the rule the call broke (and torch's own error
    when torch rejects the call with and without hmp)."""
    try:
        return follow(op, *args, **kwargs).result
    except Rejected as e:
        raise e.__cause__ from None
