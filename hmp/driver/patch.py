"""An undo log for namespace patches, undone in reverse.

Undo leaves each namespace exactly as it was: an attribute the namespace
owned is set back to the identical object, and one it only inherited (a
``torch.Tensor`` method that lives on ``torch._C.TensorBase``) is deleted.
"""

from typing import Any, NamedTuple

MISSING = object()  # Record.previous of an attribute the namespace did not own


class Record(NamedTuple):
    namespace: Any
    attr: str
    previous: Any  # the namespace's own value before, or MISSING
    value: Any  # what was set
    if_unchanged: bool = False  # undo only while the attribute still holds ``value``


def _name(namespace):
    name = getattr(namespace, "__name__", None)
    return name if isinstance(name, str) else f"<{type(namespace).__name__} at {id(namespace):#x}>"


class PatchLog:
    def __init__(self):
        self._records = []

    def __len__(self):
        return len(self._records)

    def setattr(self, namespace, attr, value, if_unchanged=False):
        """Set ``namespace.attr``, logged for undo. ``if_unchanged``: undo
        leaves the attribute alone when someone replaced ``value`` since
        (another library's wrapper on top of hmp's stays outermost)."""
        previous = namespace.__dict__.get(attr, MISSING)
        setattr(namespace, attr, value)
        self._records.append(Record(namespace, attr, previous, value, if_unchanged))

    def undo(self):
        """Undo every change, newest first, past a failing record, raising the first error at
        the end. Records not undone (or not reached after a KeyboardInterrupt) stay for the
        next undo(): torch is never left patched with no way back. Returns the
        ``if_unchanged`` records left alone because their value was replaced since."""
        first_error, failed, left = None, [], []
        while self._records:
            record = self._records.pop()
            namespace, attr, previous, value, if_unchanged = record
            try:
                if if_unchanged and namespace.__dict__.get(attr, MISSING) is not value:
                    left.append(record)
                    continue
                if previous is MISSING:
                    delattr(namespace, attr)
                else:
                    setattr(namespace, attr, previous)
            except BaseException as e:  # only a hostile namespace or an interrupt gets here
                failed.append(record)
                first_error = first_error or e
                if not isinstance(e, Exception):
                    break
        self._records.extend(reversed(failed))
        if first_error is not None:
            raise first_error
        return left

    def labels(self):
        return [f"{_name(e.namespace)}.{e.attr}" for e in self._records]

    def records(self):
        """Every Record not undone yet, oldest first."""
        return list(self._records)

    def values(self):
        """Every value set and not undone yet, oldest first."""
        return [e.value for e in self._records]
