"""The scale simulator's parts; :mod:`trainguard.sim.run` puts them together.

- ``config``: the failure mix and stage durations, with their sources.
- ``trace``: the failure trace, drawn once and replayed under every policy.
- ``fleet``: ground truth about defective machines and code versions.
- ``timeline``: where each simulated second goes (the ETTR ledger and badput buckets).
- ``pool``: the warm standby pool and its background refill.
- ``job``: the event loop a policy plugs into.
- ``guarded``: the job under trainguard's decisions; ``baselines``: requeue and restart in place.
"""
