"""The training job workflow as a package, layered bottom to top (each module imports only
those above it in this list):

- ``patches``: the ``workflow.patched`` ids, each with its reason;
- ``visibility``: search attributes, current details, telemetry export;
- ``progress``: folding the machines' reports into the job state, committing checkpoints;
- ``outcome``: how an attempt ended (stopping it everywhere, naming the cause);
- ``attempt``: one attempt (restore point -> run -> the outcome it ended with);
- ``diagnosis``: stop-time checks, pairwise rounds, the alignment test, dual-phase replay;
- ``recovery``: incident -> decision -> diagnosis -> evict / roll back / stop;
- ``workflow``: ``TrainingJobWorkflow``, its handlers and run loop.

The activities they call, and the names of the workflow's own signals, update and query, are
the contract's (``trainguard/contract/``).
"""
