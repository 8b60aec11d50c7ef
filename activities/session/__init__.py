"""One attempt of one job on this machine (a rank session), in parts, one file per stage.

Each part is a small object over the session's shared ``SessionState``, built in this order,
each on the parts before it only (``RankSession.__init__``):

- ``state``: the attempt, its directories, its result, its tasks; built first.
- ``process``: the rank processes: setup checks, argv, environment, spawn, exit records, stop.
- ``snapshots``: the runtime's shards: resume staging, memory snapshots, peer backups, uploads,
  pruning.
- ``progress``: the machine's step and metrics, and the progress reports to the workflow.
- ``ending``: the attempt's result here, once; who may stop the ranks (owner, orphan timer).
- ``incidents``: anomalies, errors, exits and health events as ``IncidentReport``s; the first
  ends the attempt.
- ``reports``: the ranks' pipes, one handler per message kind.
- ``watch``: time-based checks (hang, stuck exits) and health events.
- ``session``: ``RankSession``, the lifecycle: start, supervise, end.

``registry.Sessions`` holds every session of this machine for the agent's activities.
"""

from activities.session.process import SetupProblem
from activities.session.registry import Sessions
from activities.session.session import RankSession
from activities.session.snapshots import RestoreUnavailable

__all__ = ["RankSession", "RestoreUnavailable", "Sessions", "SetupProblem"]
