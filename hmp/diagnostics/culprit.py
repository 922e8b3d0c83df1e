"""Which op an exception came from, read off its traceback.

The innermost frame says it: when that frame is an hmp wrapper (a code
object registered with hmp/core/wrapper_frames.py), the op the wrapper
calls raised; otherwise the source of the call being executed there (the
exact expression, from Python 3.11's code positions) names it, e.g.
``torch.addmm(...)``, ``x.mm(...)`` or ``a @ b``, checked against torch.

Limits: the source must be readable (linecache) and unchanged since it was
loaded; an error raised in Python code (``raise ValueError`` inside
``nn.LSTM``) or in C++ called by C++ (autograd's backward) names no op.
"""

import ast
import dis
import itertools
import linecache

from hmp.binding.resolve import Resolver, list_names
from hmp.core.wrapper_frames import in_wrapper, innermost, wrapper_op

_OPERATORS = {
    ast.MatMult: "matmul",
    ast.Mult: "mul",
    ast.Div: "truediv",
    ast.Add: "add",
    ast.Sub: "sub",
    ast.Pow: "pow",
    ast.Mod: "remainder",
    ast.FloorDiv: "floor_divide",
}


def _source(tb):
    """The source of the expression the frame was executing, or its line."""
    code, filename = tb.tb_frame.f_code, tb.tb_frame.f_code.co_filename
    if hasattr(code, "co_positions") and tb.tb_lasti >= 0:
        try:
            start, end, col, end_col = next(itertools.islice(code.co_positions(), tb.tb_lasti // 2, None))
        except (StopIteration, ValueError, TypeError):
            start = None
        if start is not None and end is not None and col is not None and end_col is not None:
            lines = [linecache.getline(filename, n).encode("utf-8") for n in range(start, end + 1)]
            if all(lines):
                if len(lines) == 1:
                    text = lines[0][col:end_col]
                else:
                    text = lines[0][col:] + b"".join(lines[1:-1]) + lines[-1][:end_col]
                return text.decode("utf-8", "replace")
    return linecache.getline(filename, tb.tb_lineno).strip() or None


def called_name(text):
    """The op name a source snippet calls: ``torch.addmm(..)`` -> addmm,
    ``x.mm(..)`` -> mm, ``a @ b`` -> matmul; None when it is not one call."""
    tree = None
    for mode in ("eval", "exec"):
        try:
            tree = ast.parse(text.strip(), mode=mode)
            break
        except SyntaxError:
            continue
    if tree is None:
        return None
    node = tree.body if mode == "eval" else (tree.body[0] if len(tree.body) == 1 else None)
    if isinstance(node, ast.Expr):
        node = node.value
    if isinstance(node, (ast.Assign, ast.Return)) and isinstance(node.value, ast.Call):
        node = node.value  # a whole line: its outermost call
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute):
            return func.attr
        if isinstance(func, ast.Name):
            return func.id
        return None
    if isinstance(node, (ast.BinOp, ast.AugAssign)):
        return _OPERATORS.get(type(node.op))
    return None


def entry_name(attribute):
    """The list entry that binds an attribute name: ``__rmul__`` -> mul, ``mul_`` -> mul."""
    resolver = Resolver()
    return next((c for c in list_names(attribute) if resolver.exists(c)), None)


def callee(exc):
    """The torch op the innermost frame was calling when ``exc`` was raised,
    or None when it is unknown or the wrapper handling ``exc`` called it."""
    first = exc.__traceback__
    tb = innermost(first)
    if tb is None:
        return None
    if in_wrapper(tb):
        if tb is first:  # the wrapper now handling exc: its own op raised
            return None
        # an inner wrapper that called its op uncast (disable_casts, or inside a wrapped op)
        name = getattr(wrapper_op(tb.tb_frame), "__name__", None)
        return entry_name(name) if isinstance(name, str) else None
    text = _source(tb)
    name = called_name(text) if text else None
    return entry_name(name) if name else None


def raising_frame(exc):
    """The frame whose own ``raise`` statement raised ``exc`` (a module's dtype
    check, such as nn.RNNBase.check_input), or None when an op raised it."""
    tb = innermost(exc.__traceback__)
    if tb is None or in_wrapper(tb):
        return None
    code = tb.tb_frame.f_code
    if not 0 <= tb.tb_lasti < len(code.co_code) or dis.opname[code.co_code[tb.tb_lasti]] != "RAISE_VARARGS":
        return None
    return tb.tb_frame
