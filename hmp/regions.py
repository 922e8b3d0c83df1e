"""The DataLoader worker entry point's import path before hmp 0.1's layout
(hmp/rules/regions.py now). A spawn-started worker imports its entry point
by the name its parent pickled: a parent that began training under an earlier
hmp and starts workers after the install changed (workers start again each
epoch) names this module."""

from hmp.rules.regions import worker_loop

__all__ = ["worker_loop"]
