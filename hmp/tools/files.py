"""Writing several output files all or nothing (tune's list files)."""

import os
import secrets
import stat
from pathlib import Path


def check_outputs(paths, tool):
    """The real paths (symlinks followed) of ``paths``, each checked to be
    writable as a new or replaced file, and no two the same file; a
    ValueError naming the path otherwise. Nothing is written."""
    seen = {}
    for given in paths:
        real = Path(os.path.realpath(given))
        if real in seen:
            raise ValueError(
                f"{tool}: {os.fspath(seen[real])!r} and {os.fspath(given)!r} are the same file ({real}); "
                f"give each its own path"
            )
        seen[real] = given
        folder = real.parent
        if real.is_dir():
            raise ValueError(f"{tool}: cannot write {os.fspath(given)!r}: it is a directory")
        if not folder.is_dir():
            why = "is not a directory" if folder.exists() else "does not exist"
            raise ValueError(f"{tool}: cannot write {os.fspath(given)!r}: {str(folder)!r} {why}")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ValueError(
                f"{tool}: cannot write {os.fspath(given)!r}: the directory {str(folder)!r} is not writable"
            )
        if real.exists() and not os.access(real, os.W_OK):
            raise ValueError(f"{tool}: cannot write {os.fspath(given)!r}: the file is not writable")
    return list(seen)


def write_all(texts, tool):
    """Write ``[(path, text)]``: every path is checked first (check_outputs),
    each text goes to a temporary file beside its target, and only when all
    are written are they renamed into place (os.replace). On an error no
    target has changed, and no temporary file is left."""
    targets = check_outputs([path for path, _ in texts], tool)
    written = []
    try:
        for target, (_, text) in zip(targets, texts):
            temp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for open()
            written.append((temp, target))
            with os.fdopen(fd, "w") as f:
                f.write(text)
            if target.exists():
                os.chmod(temp, stat.S_IMODE(os.stat(target).st_mode))
    except BaseException:
        for temp, _ in written:
            temp.unlink(missing_ok=True)
        raise
    for temp, target in written:
        os.replace(temp, target)
