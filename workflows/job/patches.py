"""``workflow.patched`` ids of the job workflow, each with the change it guards.

A history recorded before a change replays without it (the id is absent there); the ids
travel in recorded histories, so they never change.
"""

from __future__ import annotations

# Recovered incidents are handed to a controller for their spans and metrics.
INCIDENT_TELEMETRY = "incident-telemetry"
# Progress-driven choices (search-attribute rate, fail-slow rounds) read the reports' own clock,
# not the workflow's: the same choice whenever the worker processes the signal (a query-driven
# replay after a server restart processed them at an earlier workflow time than the task that
# recorded them, and a history became nondeterministic).
REPORT_CLOCK = "report-clock"
# On a failure, the machines still training are told to stop at once, not by a cancellation
# that waits for their next heartbeat (meanwhile a corrupt job trains on and writes checkpoints).
STOP_AT_ONCE = "stop-at-once"
# A machine whose run_ranks missed its heartbeats is asked to re-attach before it counts as lost:
# when the Temporal server (not the machine) was away, its ranks trained on all along.
REATTACH = "reattach-after-heartbeat-timeout"
# A long job continues as new between attempts once its history is large: the next attempt
# then starts in a fresh run instead of re-attaching to ranks that a mid-attempt
# continue-as-new leaves running (weeks of incidents grow a history past the server's limits).
CAN_BETWEEN_ATTEMPTS = "continue-as-new-between-attempts"
# A memory copy of the same step as the newest S3 checkpoint is restored from memory, not
# downloaded (a persist that committed just before the failure made the two equal).
MEMORY_ON_TIE = "memory-on-tie"
# A code update restarts without waiting for the S3 commits in flight, as a failure does: the
# next attempt restores from memory, and with a persist every few seconds one is often under way.
UPDATE_AT_ONCE = "update-without-commit-wait"
# The step the machines' ranks had finished when the attempt ended (in their run_ranks results)
# counts as progress before the failure is judged: a large job reports its step every few
# minutes, and recoveries that trained between two reports looked like a crash loop.
STEPS_FROM_RESULTS = "steps-from-results"
# The decision ladder's first rung: a first failure is reattempted in place at once.
FIRST_REATTEMPT = "first-reattempt"
# `cancel`: the job ends now - its ranks stopped without waiting for the S3 commits in flight
# (the checkpoints already committed stay), its machines released.
CANCEL_AT_ONCE = "cancel-at-once"
# A job whose ranks did not all use the runtime (a script run as it is) completes when every rank
# exits 0, at the step seen last, without a parameter hash.
SCRIPT_COMPLETION = "script-completion"
# Webhook notifications (incident, eviction, the job's end) through the `notify` activity.
NOTIFY = "notify"
# A job's notifications are posted one after another (each once the one before was delivered or
# given up), not all at once: the incident reached a hook after the eviction it caused.
NOTIFY_IN_ORDER = "notify-in-order"
# A step's shards are committed only together with shards of the same attempt: a step uploaded in
# part by a failed attempt and again by the next no longer mixes the two (shard keys name the attempt).
SHARDS_OF_ONE_ATTEMPT = "shards-of-one-attempt"
# A machine whose heartbeats timed out is waited for (the re-attach pick-up) longer than its agent's
# fence: one merely cut off from Temporal has stopped its ranks before its replacement starts.
# When its fence makes the peers fail first, a machine that missed its heartbeats and does not
# answer the stop either is reported lost (evicted), not reattempted in place.
FENCE_BOUND = "fence-bound"
# A stall that stack aggregation did not localize, back again (a hang, or a rendezvous that cannot
# form), runs the stop-time checks on every machine; a failed pair whose machines pass alone names
# the link between them, and one end of it is swapped for a spare (both suspect).
LINK_CHECKS = "link-checks"
# When every report of a failure so far is a peer's effect (a collective error, a failed
# rendezvous), the machines still running get a short grace to report on their own before they
# are stopped: a machine whose ranks died first was cancelled while its agent was still finishing
# (checkpoint upload, hardware probe), its report lost, and a peer's `comm` became the incident.
CAUSE_GRACE = "cause-grace"
# A user's stop persists the machines' newest memory snapshots (stop_ranks with ``persist``, a
# longer bound) and commits the newest step every machine sent: S3 otherwise holds the last
# periodic persist, up to `checkpoint.persist_every_s` old.
PERSIST_AT_STOP = "persist-at-stop"
# A call on more machines than a workflow should keep activities pending for (a job of hundreds
# of machines) runs through FanOutWorkflow children, a chunk of machines each.
FANOUT = "fanout-children"
# A job of more machines than a group (workflows.job.group) runs its ranks through groups of
# machines (child workflows) that its machines report to.
GROUPS = "machine-groups"
# A pair round of more pairs than ``workflows.job.diagnosis.PAIRS_AT_ONCE`` runs that many pairs
# at a time: each keeps up to two activities pending in the job's workflow, and all 600 pairs of
# a 1,200-machine job at once were 1,200 pending.
PAIR_WAVES = "pair-waves"
# A machine's incident arrives ahead of its result (``ProgressReport.incident``, forwarded by its
# group in ``GroupNews.raised``): the cause grace ends on it, and it names the cause when the
# machine's result was cancelled. Before it, a machine whose end's work passed the grace (ranks
# stopped, pipes read, checkpoints stored, hardware probed: seconds on a loaded machine) had a
# peer's effect, a broken collective, taken for the cause.
INCIDENT_AT_ONCE = "incident-at-once"
# A user's stop or cancel during a failure's diagnosis cancels its checks and ends the job (it
# waited for them before, then started the next attempt only to stop it: at 1,200 machines the
# stop-time checks' pair rounds kept a stop waiting past 300 s).
STOP_DIAGNOSIS = "stop-diagnosis"
# A group keeps one timer for its next summary instead of starting one each time a report wakes
# it (each wait with a timeout starts a timer): at 1,200 machines that was a timer per report,
# 7,500 an hour, the largest share of a steady job's actions after the reports themselves.
GROUP_SUMMARY_TIMER = "group-summary-timer"
# A group continues as new at its own limits (``GROUP_MAX_HISTORY`` events or
# ``GROUP_MAX_HISTORY_BYTES``), not when the server first suggests it (4,096 events or 4 MB on a
# default server): each continue-as-new re-attaches every machine of the group (a ``run_ranks``
# each, 200), and a group of a 1,200-machine job reached the suggestion about every 25 minutes.
GROUP_OWN_HISTORY_LIMIT = "group-own-history-limit"
