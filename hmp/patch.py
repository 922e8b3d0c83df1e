"""An undo log for namespace patches, undone in reverse.

Undo leaves each namespace exactly as it was: an attribute the namespace
owned is set back to the identical object, and one it only inherited (a
``torch.Tensor`` method that lives on ``torch._C.TensorBase``) is deleted.
"""

_MISSING = object()


class PatchLog:
    def __init__(self):
        self._entries = []  # (namespace, attr, previous own value or _MISSING, value set)

    def __len__(self):
        return len(self._entries)

    def setattr(self, namespace, attr, value):
        previous = namespace.__dict__.get(attr, _MISSING)
        setattr(namespace, attr, value)
        self._entries.append((namespace, attr, previous, value))

    def undo(self):
        """Undo every change, newest first. Keeps going past a failing entry
        and raises the first error at the end, so one bad entry cannot leave
        the rest patched. Entries that could not be undone (and, after a
        KeyboardInterrupt, those not reached) stay in the log, so the next
        undo() retries them: torch is never left patched with no way back."""
        first_error, failed = None, []
        while self._entries:
            entry = self._entries.pop()
            namespace, attr, previous, _ = entry
            try:
                if previous is _MISSING:
                    delattr(namespace, attr)
                else:
                    setattr(namespace, attr, previous)
            except BaseException as e:  # only a hostile namespace or an interrupt gets here
                failed.append(entry)
                first_error = first_error or e
                if not isinstance(e, Exception):
                    break
        self._entries.extend(reversed(failed))
        if first_error is not None:
            raise first_error

    def labels(self):
        return [f"{getattr(ns, '__name__', ns)}.{attr}" for ns, attr, _, _ in self._entries]

    def entries(self):
        """``(namespace, attr, previous or _MISSING, value set)``, oldest first."""
        return list(self._entries)

    def values(self):
        """Every value set and not undone yet, oldest first."""
        return [value for _, _, _, value in self._entries]
