"""trainguard's process entry points: the controller, the node agent, the Slurm worker.

They run as ``python -P -m workers.<name>``. ``-P`` keeps the directory they start in off the
import path; that directory is often a user's (the agent's --code-dir, a Slurm submit
directory), and a package of theirs named ``activities``, ``workflows`` or ``infra`` must never
stand in for trainguard's (docs/architecture.md, "Package names"). Started without ``-P``, the
same holds from here on: the start directory leaves the path before any other package of ours
is imported, unless it is the one these packages live in (a checkout).
"""

from __future__ import annotations

import os
import sys

_HOME = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_START = os.getcwd()
if _START != _HOME:
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _START]
