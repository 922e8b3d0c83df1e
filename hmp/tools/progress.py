"""Progress of long work on stderr: a tqdm bar on a terminal; on a log or a
pipe (CI, ``2> log``), or without tqdm, a plain line every ``every_s``
seconds with the count done and the time left, so a run that takes minutes
never looks hung and a log never fills with bar redraws. Nothing shows
before ``delay_s``: work that ends sooner says nothing.

The time left is the time so far per unit done times the units left, so it
tracks the work done; the tools count in runs of the user's step
(``StepRuns``), units of one size, and add to the total as each phase
learns how many it needs.

One bar for the whole run, all phases, that only moves forward: the total
grows as phases announce their runs, so done/total can fall (a phase ends
at 100 %, the next adds runs); the bar shows the largest share so far,
short of 100 % (SHORT_OF_ALL) until the work ends (close() with a message),
and the runs done and known so far beside it."""

import sys
import time

try:
    from tqdm import tqdm
except ImportError:  # tqdm is the `demo` extra
    tqdm = None


SCALE = 1000  # the terminal bar counts thousandths of the work
SHORT_OF_ALL = 0.99  # the most the bar shows before the work has ended


def forward(shown, done, total):
    """The share of the work to show: ``done/total``, never less than ``shown`` (what was shown before),
    never more than SHORT_OF_ALL while running; 0 while nothing is known."""
    share = min(done / total, SHORT_OF_ALL) if total else 0.0
    return max(shown, share)


class Progress:
    """``label``: what is counted (``training fp32``); ``total``: how many
    ``unit``s, None until known (``set_total``); ``prog``: the command's name
    that starts each plain line."""

    def __init__(self, label, total, prog, unit="step", every_s=10.0, delay_s=0.0):
        self.label, self.total, self.prog, self.unit, self.every_s = label, total, prog, unit, every_s
        self.delay_s = delay_s
        self.done = 0
        self.shown = 0.0  # the share of the work the bar shows: only grows (forward())
        self.bar = None
        if tqdm is not None and sys.stderr.isatty():
            self.bar = tqdm(
                total=SCALE,
                desc=label,
                leave=True,
                file=sys.stderr,
                dynamic_ncols=True,
                mininterval=0.5,
                delay=delay_s,
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}<{remaining}{postfix}",
            )
        self.start = self.last = time.perf_counter()
        self.said = False  # a plain line was printed (after delay_s)
        if self.bar is None and not delay_s:
            self._first()

    def _first(self):
        self.said = True
        self.note(
            f"{self.label}: {self.total} {self.unit}s"
            if self.total is not None
            else f"{self.label}: counting {self.unit}s"
        )

    def note(self, message):
        """A line of its own, above the bar when there is one."""
        line = f"{self.prog}: {message}"
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def set_total(self, total):
        if total == self.total:
            return
        self.total = total  # said with the next count, not a line of its own; the bar never moves back

    def step(self, postfix="", done=None):
        """One more done (or ``done`` in all); ``postfix``: what it was."""
        self.done = self.done + 1 if done is None else done
        self.shown = forward(self.shown, self.done, self.total)
        if self.bar is not None:
            known = "" if self.total is None else f"/{self.total}"
            self.bar.set_postfix_str(
                f"{self.unit} {self.done}{known}{', ' + postfix if postfix else ''}", refresh=False
            )
            self.bar.update(round(self.shown * SCALE) - self.bar.n)
            return
        now = time.perf_counter()
        if not self.said:
            if now - self.start < self.delay_s:
                return
            self._first()
            self.last = now
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
        """End the bar: full when the work ended (``message``), where it was when it did not."""
        if self.bar is not None:
            if message is not None:
                self.shown = 1.0
                self.bar.update(SCALE - self.bar.n)
            self.bar.close()
        if message is not None and (self.said or self.bar is not None or not self.delay_s):
            self.note(message)


def bar(label, prog):
    """``(progress, report)``: a Progress counting runs of the step from the start (a command line's:
    ``prog`` leads its lines), and the ``report(done, total, what)`` the tools call after each run."""
    shown = Progress(label, None, prog, unit="run")

    def report(done, total, what):
        shown.set_total(total)
        shown.step(what, done=done)

    return shown, report


class StepRuns:
    """The runs of the user's step a tool makes, counted for progress:
    ``counted(fn)`` wraps the step so each call is one done; ``expect(n)``
    adds ``n`` runs to the total as a phase learns how many it needs;
    ``phase(what)`` names what the next runs are for; ``later(n)``: the runs of
    the phases still to come, as far as known, so the total (and the time
    left) counts them before they start. ``report(done, total,
    what)`` is called after each run (hmp.tune's ``progress`` argument), or
    with ``report=None`` a Progress bar on stderr shows them (after a few
    seconds; ``report=False``: nothing)."""

    def __init__(self, tool, report=None, delay_s=3.0, label="measuring"):
        self.done, self.total, self.what = 0, 0, ""
        self.ahead = 0  # runs the phases after the current one will make, as far as known now (later())
        self.bar = None
        if report is None:
            self.bar = Progress(label, None, tool, unit="run", delay_s=delay_s)
            report = self._show
        self.report = report or (lambda done, total, what: None)

    def _show(self, done, total, what):
        self.bar.set_total(total)
        self.bar.step(what, done=done)

    def counted(self, fn):
        def run(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            finally:
                self.done += 1
                self.total = max(self.total, self.done)
                self.report(self.done, self.total + self.ahead, self.what)

        return run

    def expect(self, runs, what=None):
        self.total += runs
        if what is not None:
            self.what = what

    def phase(self, what):
        self.what = what

    def later(self, runs):
        """The runs the phases after the current one will make, as far as known now: counted in the total
        (so the time left counts the phases left), replaced at each call, never part of ``total``."""
        self.ahead = max(0, runs)

    def close(self, message=None):
        if self.bar is not None:
            self.bar.close(message)
