"""The contract between trainguard's processes: every message Temporal carries, named once.

- ``calls``: the activities (name, input, result, options), run from workflows by reference;
- ``job``: ``TrainingJobWorkflow``: its type, signals, update and query;
- ``pool``: ``NodePoolWorkflow`` (the pool's coordinator): its type, signal, updates and queries;
- ``shard``: ``PoolShardWorkflow`` (a pool's shard): its type, signals, updates and queries;
- ``group``, ``fanout``: the children a large job starts (its machine groups, its fan-outs);
- ``kinds``: the typed call of each kind (activity, workflow, signal, update, query).

Both sides use the same entry: a workflow defines its handler under the entry's name
(``@workflow.signal(name=contract.job.stop.name)``), an activity registers under it
(``@activity.defn(name=calls.run_ranks.name)``), a caller sends through it
(``await contract.job.stop.signal(handle, reason)``). No other module spells a message name
(tests/unit/test_message_names.py). The names are what Temporal stores in every history:
renaming one breaks running workflows, recorded histories and the previous release's
processes.

Names and types only, importable from the workflow sandbox: no torch, boto3 or subprocess, and
of the project only ``trainguard.domain``.
"""

from trainguard.contract import calls, fanout, group, job, kinds, pool, shard

__all__ = ["calls", "fanout", "group", "job", "kinds", "pool", "shard"]
