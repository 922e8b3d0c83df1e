"""Which frames are hmp wrappers: the wrappers register their code objects,
and an exception's traceback says whether the op a wrapper called raised it
(its innermost frame is the wrapper's: a C function raised before any other
Python ran). The error path's search for the code that raised is
hmp/diagnostics/culprit.py's."""

# kept: registrations made at import by the floors above, which core must not import
_wrappers = {}  # code object of an hmp wrapper -> op_of(frame), the op that frame calls
WRAPPER_CODES = _wrappers.keys()  # a live view: the code objects of hmp's wrappers


def _op_local(frame):
    return frame.f_locals.get("op")


def register_wrapper(code, op_of=_op_local):
    """Make frames running ``code`` count as hmp wrapper frames; ``op_of(frame)``
    gives the op such a frame calls (by default its local ``op``)."""
    _wrappers[code] = op_of


def wrapper_op(frame):
    """The op an hmp wrapper frame calls, or None when ``frame`` is not one."""
    op_of = _wrappers.get(frame.f_code)
    return None if op_of is None else op_of(frame)


def innermost(tb):
    if tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb


def in_wrapper(tb):
    """True when traceback entry ``tb`` is a frame of an hmp wrapper."""
    return tb is not None and tb.tb_frame.f_code in _wrappers


def raised_by_the_op(exc):
    """True when ``exc`` came straight out of the op an hmp wrapper called (a
    C function: nothing ran before its kernel was chosen): the innermost
    frame of its traceback is the wrapper's."""
    return in_wrapper(innermost(exc.__traceback__))
