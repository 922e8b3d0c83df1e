"""Progress of a long command on stderr: a tqdm bar on a terminal; on a log
or a pipe (CI, ``2> log``), or without tqdm, a plain line every
``every_s`` seconds with the count done and the time left, so a run that
takes minutes never looks hung and a log never fills with bar redraws."""

import sys
import time

try:
    from tqdm import tqdm
except ImportError:  # tqdm is the `demo` extra
    tqdm = None


class Progress:
    """``label``: what is counted (``training fp32``); ``total``: how many
    ``unit``s, None until known (``set_total``); ``prog``: the command's name
    that starts each plain line."""

    def __init__(self, label, total, prog, unit="step", every_s=10.0):
        self.label, self.total, self.prog, self.unit, self.every_s = label, total, prog, unit, every_s
        self.done = 0
        self.bar = None
        if tqdm is not None and sys.stderr.isatty():
            self.bar = tqdm(
                total=total, desc=label, unit=unit, leave=True, file=sys.stderr, dynamic_ncols=True, mininterval=0.5
            )
        self.start = self.last = time.perf_counter()
        if self.bar is None and total is not None:
            self.note(f"{label}: {total} {unit}s")

    def note(self, message):
        """A line of its own, above the bar when there is one."""
        line = f"{self.prog}: {message}"
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def set_total(self, total):
        self.total = total
        if self.bar is not None:
            self.bar.total = total
            self.bar.refresh()
        else:
            self.note(f"{self.label}: {total} {self.unit}s" + (f", {self.done} done" if self.done else ""))

    def step(self, postfix="", done=None):
        """One more done (or ``done`` in all); ``postfix``: what it was."""
        before, self.done = self.done, self.done + 1 if done is None else done
        if self.bar is not None:
            self.bar.set_postfix_str(postfix, refresh=False)
            self.bar.update(self.done - before)
            return
        now = time.perf_counter()
        if now - self.last < self.every_s or (self.total is not None and self.done >= self.total):
            return
        self.last = now
        count = f"{self.unit} {self.done}" + ("" if self.total is None else f"/{self.total}")
        left = (
            ""
            if self.total is None or not self.done
            else f", about {(now - self.start) / self.done * (self.total - self.done):.0f} s left"
        )
        self.note(f"{self.label}: {count}{', ' + postfix if postfix else ''}{left}")

    def elapsed(self):
        return time.perf_counter() - self.start

    def close(self, message=None):
        if self.bar is not None:
            self.bar.close()
        if message is not None:
            self.note(message)
