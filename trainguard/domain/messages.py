"""Messages between the workflows, the activities and the agents.

One immutable model per message, carried by ``temporalio.contrib.pydantic``.
Payloads stay small: checkpoint shards are referenced by S3 key, never inlined.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import Field

from trainguard.domain.identity import AuditEntry
from trainguard.domain.pool_layout import DEFAULT_SHARDS, MAX_SHARDS
from trainguard.domain.spec import JobSpec, Topology
from trainguard.domain.wire import WireModel

CONTROLLER_QUEUE = "trainguard-controller"
POOL_WORKFLOW_ID = "trainguard-pool"
# Machine names become task queue names and directory names (host names fit).
NODE_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"


def node_queue(node: str, pool: str = POOL_WORKFLOW_ID) -> str:
    """The task queue a node agent polls: work for that machine and no other. Machine names
    may repeat across pools (two Slurm clusters both have an ``n1``): outside the default
    pool the queue carries the pool's id."""
    queue = f"node-{node}" if not node.startswith("node-") else node
    return queue if pool == POOL_WORKFLOW_ID else f"{queue}@{pool}"


def slurm_queue(pool: str) -> str:
    """The task queue of the Slurm worker serving ``pool`` (the one place with operator rights)."""
    return f"slurm-{pool}"


class Msg(WireModel):
    """Frozen; a field a newer release added is dropped (see trainguard.domain.wire)."""


# -- node pool -----------------------------------------------------------------


class NodeInfo(Msg):
    name: str
    task_queue: str
    host: str = "127.0.0.1"
    gpus: int = 0
    # The machine's CPUs (0: not reported): `trainguard run --nproc-per-node auto|cpu` reads it.
    cpus: int = 0
    # The public half of the agents' machine key: secret values are sealed to it
    # (trainguard.services.sealed); None: this agent cannot open them.
    sealing_key: str | None = None
    # Warm rank processes the agent keeps (its memory-budgeted target when it registered).
    warm_ranks: int = 0


# suspect: waiting for its self-test (new, returning, or evicted with a group); standby: passed it,
# ready for a job; active: with a job; quarantined: failed a check or blamed for a fault.
NodeState = Literal["active", "standby", "quarantined", "suspect", "lost"]


class PoolNode(Msg):
    info: NodeInfo
    state: NodeState = "suspect"
    job: str | None = None
    reason: str | None = None
    since: datetime | None = None
    # The latest self-test: when, and what it said.
    tested_at: datetime | None = None
    evidence: str | None = None
    # A suspect whose self-test did not run (its agent slow or away): how often in a row, and
    # when to try again.
    missed_tests: int = 0
    retest_at: datetime | None = None
    # Cordoned by an operator: given no new job; the job it has goes on.
    cordoned: bool = False


class ReserveInput(Msg):
    job_id: str
    count: int = Field(ge=1)
    # Which NodePoolWorkflow (one per cluster or allocation) the job takes machines from.
    pool: str = POOL_WORKFLOW_ID


class CordonInput(Msg):
    node: str
    cordoned: bool = True


class ReserveResult(Msg):
    granted: bool
    nodes: list[NodeInfo] = []
    free: int = 0
    message: str = ""
    # Machines on standby after this call (None from a pool that does not say).
    standby: int | None = None


class ReleaseInput(Msg):
    job_id: str
    pool: str = POOL_WORKFLOW_ID
    # The job's machines: their names say which shards hold them (empty: the pool's own
    # account of where the job holds machines is asked).
    nodes: list[str] = []


class EvictInput(Msg):
    """Quarantine ``nodes`` (held by ``job_id``) and give the job spares in their places."""

    job_id: str
    nodes: list[str]
    reason: str
    current: list[str]  # the job's machines in rank-block order
    # False when the machines are only suspected (a whole group evicted for one outlier): they
    # go to ``suspect`` and back to standby once they pass the self-test, not to quarantine.
    confirmed: bool = True
    # Names this eviction across retries (the activity's run and id): a retried request gets the
    # first one's answer instead of evicting again.
    request_id: str = ""
    pool: str = POOL_WORKFLOW_ID


class EvictResult(Msg):
    replaced: bool
    nodes: list[NodeInfo] = []  # the job's machines after the swap, same order
    evicted: list[str] = []
    message: str = ""
    # Machines on standby after this call (None from a pool that does not say).
    standby: int | None = None


class PoolConfig(Msg):
    """How the pool sizes and heals itself."""

    # Failures per machine per day: the standby target is the 99th percentile of
    # Binomial(machines in use, rate) per job (trainguard.domain.standby).
    daily_failure_rate: float = Field(0.0012, ge=0, le=1)
    min_standby: int = Field(1, ge=0, le=10_000)
    # A quarantined machine runs its self-test again this often; it returns when it passes.
    retest_s: float = Field(1800.0, gt=0, le=30 * 86400)
    # A production pool refuses injected faults (drills) whoever asks.
    production: bool = False
    # Shard workflows the machines are spread over (trainguard.domain.pool_layout), at most about
    # 1,000 machines each; fixed once machines joined.
    shards: int = Field(DEFAULT_SHARDS, ge=1, le=MAX_SHARDS)


class PoolState(Msg):
    nodes: dict[str, PoolNode] = {}
    config: PoolConfig = PoolConfig()
    # The latest evictions' answers by request id, so a retry is answered, not acted on twice.
    evictions: dict[str, EvictResult] = {}
    # Filled in by the ``state`` query: spares wanted for the jobs running now, and spares ready.
    standby_target: int = 0
    standby: int = 0
    # Slurm (``workers.slurm``): the task queue of the worker that drains and resumes this pool's
    # machines (None: no Slurm), the machines drained in Slurm as far as the pool knows (name ->
    # reason), those an operator drained (they stay out until resumed or released), and a count
    # of the pool's own drains and resumes (an observation read before one of them is stale).
    slurm_queue: str | None = None
    slurm_drained: dict[str, str] = {}
    slurm_held: list[str] = []
    slurm_epoch: int = 0
    # Whether the Slurm worker can start replacement agents, and the number of live machines
    # when it was last asked to (None: no request outstanding).
    slurm_replacements: bool = False
    slurm_requested: int | None = None
    # Who operated the pool's machines and settings, and when (workflows.identity).
    audit: list[AuditEntry] = []
    # A sharded pool: its shard count (0: the pool runs in one workflow), each shard's
    # ``slurm_epoch`` (an observation is checked per shard), and what only the coordinator
    # carries across continue-as-new.
    shards: int = 0
    slurm_epochs: list[int] = []
    coordinator: CoordinatorState | None = None


class SlurmAttach(Msg):
    """A Slurm worker serves the pool on ``queue``; ``replacements``: it can submit agent jobs."""

    queue: str
    replacements: bool = False


class SlurmReplacementInput(Msg):
    """Submit one more agent job to Slurm, kept off ``exclude`` (drained, quarantined)."""

    exclude: list[str] = []


class SlurmNodeInput(Msg):
    """Drain (with ``reason``) or resume one machine in Slurm."""

    node: str = Field(pattern=NODE_NAME_RE)
    drain: bool
    reason: str = ""


class SlurmObservation(Msg):
    """What Slurm says of the pool's machines (name -> drain reason, or None when not
    drained), read after the pool's ``slurm_epoch`` was ``epoch``."""

    epoch: int
    nodes: dict[str, str | None]
    # A sharded pool's ``slurm_epochs``, as read with the state (``epoch`` is then unused).
    epochs: list[int] = []


# -- the sharded pool (trainguard.domain.pool_layout) ---------------------------------------


class ShardSettings(Msg):
    """What the coordinator tells every shard: the pool's settings, numbered so a shard that
    missed a change (started later, or between runs) is told again."""

    config: PoolConfig = PoolConfig()
    epoch: int = 0
    slurm_queue: str | None = None


class Gate(Msg):
    """While jobs wait in the pool's queue, shards give machines to the one at its head only
    (a running job's replacements excepted): small jobs cannot starve a large one."""

    head: str | None = None
    epoch: int = 0


class ShardSummary(Msg):
    """A shard's counts, signalled to the coordinator when they change (at most once a second)."""

    index: int
    shards: int
    states: dict[str, int] = {}
    # Standbys a job can take now (not cordoned, not drained in Slurm), and cordoned idle ones.
    free: int = 0
    cordoned_free: int = 0
    # Its first free standby in natural name order: shards are asked in that order, so a pool
    # gives machines by name (node-1, node-2, ...) whatever shard holds them.
    first_free: str | None = None
    jobs: dict[str, int] = {}  # machines per job
    # Quarantined or drained in Slurm: kept off a replacement request's nodes.
    out_of_service: list[str] = []
    # The settings and gate the shard runs with (older than the coordinator's: sent again).
    settings_epoch: int = 0
    gate_epoch: int = 0


class Ticket(Msg):
    """A job's place in the pool's queue of reservations (first come, first served)."""

    job_id: str
    count: int
    since: datetime
    renewed_at: datetime


class TicketInput(Msg):
    job_id: str
    count: int = Field(ge=1)


class PoolLayout(Msg):
    """The coordinator's answer to where things are: the shards and their free standbys, the
    queue (and, asked for a job, that job's ticket and the shards holding its machines)."""

    sharded: bool
    shards: int = DEFAULT_SHARDS
    settings: ShardSettings = ShardSettings()
    gate: Gate = Gate()
    # From the shards' summaries: free standbys per shard (index = shard), and pool totals.
    free: list[int] = []
    first_free: list[str | None] = []  # each shard's first free standby by name
    testing: int = 0
    cordoned_free: int = 0
    machines: int = 0
    waiting: int = 0  # jobs in the queue
    ticket: Ticket | None = None
    place: int = 0  # the ticket's place in the queue (1: the head)
    holders: list[int] = []


class CoordinatorState(Msg):
    """What the coordinator carries across continue-as-new besides the config."""

    settings_epoch: int = 0
    summaries: dict[int, ShardSummary] = {}
    queue: list[Ticket] = []
    gate: Gate = Gate()


class ShardRequest(Msg):
    """What one eviction did in one shard, kept for its retries."""

    job_id: str
    granted: list[str] = []  # standbys given to the job in the evicted machines' places
    evicted: list[str] = []  # machines this shard took from the job
    # At the eviction's home shard (its first machine's): the whole swap, once done.
    swap: dict[str, str] = {}
    standby: int | None = None


class ShardState(Msg):
    """A shard's machines and what it needs to serve them; carried across continue-as-new."""

    pool: str
    index: int
    shards: int
    settings: ShardSettings = ShardSettings()
    gate: Gate = Gate()
    nodes: dict[str, PoolNode] = {}
    requests: dict[str, ShardRequest] = {}
    slurm_drained: dict[str, str] = {}
    slurm_held: list[str] = []
    slurm_epoch: int = 0
    # Who operated this shard's machines, and when (workflows.identity).
    audit: list[AuditEntry] = []


class HoldInput(Msg):
    """Give ``job_id`` standbys of one shard: ``count`` in all (a retry returns the same), or
    nothing; ``up_to``: as many as there are, up to ``count``. With ``request_id``: an eviction's
    replacements, remembered per request and never gated."""

    job_id: str
    count: int = Field(ge=1)
    head: bool = False  # the job at the head of the queue: it passes the gate
    up_to: bool = False
    request_id: str = ""


class HoldResult(Msg):
    nodes: list[NodeInfo] = []
    free: int = 0  # what the shard has left


class UnholdInput(Msg):
    """Return the job's machines in one shard to standby (only an eviction's replacements, with
    ``request_id``: an eviction that found too few gives back what it took)."""

    job_id: str
    request_id: str = ""


class EvictHereInput(Msg):
    """The machines of one eviction that one shard holds: quarantined (or made suspect)."""

    job_id: str
    request_id: str
    nodes: list[str]
    reason: str
    confirmed: bool = True
    # At the home shard: the whole swap, recorded for the eviction's retries.
    swap: dict[str, str] = {}
    standby: int | None = None


class ShardAdopt(Msg):
    """Machines handed to a shard as they stand (jobs kept): a pool crossing to shards."""

    nodes: list[PoolNode]
    slurm_drained: dict[str, str] = {}
    slurm_held: list[str] = []


class ShardDelivery(Msg):
    """Signal-with-start on one shard (controller activity): agents that joined through the
    coordinator, or machines handed over."""

    start: ShardState
    join: list[NodeInfo] = []
    adopt: ShardAdopt | None = None


# -- checkpoints -----------------------------------------------------------------


class ShardInfo(Msg):
    rank: int
    step: int
    key: str
    size: int
    sha256: str


class CheckpointRef(Msg):
    """A complete checkpoint: its manifest was written after every shard."""

    step: int
    uri: str
    shards: list[ShardInfo]
    # How many parts hold the shards (a large job's checkpoint: ``shards`` is then empty, and
    # ``checkpoint_shards`` gives a range of ranks theirs); 0: ``shards`` lists them all.
    parts: int = 0


class ScriptCheckpointRef(Msg):
    """One of a script's own checkpoints (``--checkpoint-dir``), complete in S3: what the agent
    tells the job of it, and what the job hands the next attempt to restore
    (``trainguard.domain.script_checkpoints`` has the layout; ``uri`` is its manifest's)."""

    name: str
    kind: str  # "file" | "dcp"
    # The writing machine's modification time (ns) of the save: newer saves of a name have larger.
    order: int
    attempt: int
    # The newest step every rank of the writing machine had reported when it was stored (the
    # save's own step is not known to the agent): None before the first step.
    step: int | None = None
    size: int = 0
    created_at: datetime
    uri: str


class PartRef(Msg):
    """One group's part of a checkpoint step: the shards of ranks ``first_rank`` to
    ``first_rank + ranks - 1``, listed in the object at ``key``."""

    group: int
    step: int
    key: str
    first_rank: int
    ranks: int


class JobGauges(Msg):
    """A job's progress as metrics: handed to controller activities that run anyway."""

    step: int
    ettr: float
    ettr_window_1h: float


class CommitCheckpointInput(Msg):
    job_id: str
    prefix: str
    step: int
    world_size: int
    # Every rank's shard, or none where ``parts`` lists the parts that hold them.
    shards: list[ShardInfo]
    keep: int
    # The newest step the replicas agreed on: the newest checkpoint at or before it is kept.
    verified_step: int | None = None
    # The job's progress when the commit started, recorded as metrics by the controller.
    gauges: JobGauges | None = None
    # The attempt whose shards these are: refused when the job is on a newer one (None: unchecked).
    attempt: int | None = None
    # A fresh run: checkpoints of attempts before this one are an earlier run's, pruned as older.
    min_attempt: int | None = None
    # The parts (``commit_checkpoint_part``) that together list every rank's shard once: a large
    # job's commit, whose shard list would not fit one payload. Needs ``attempt``.
    parts: list[PartRef] = []


class CommitCheckpointPartInput(Msg):
    """One group's shards of a step: ranks ``first_rank`` to ``first_rank + ranks - 1``."""

    job_id: str
    prefix: str
    step: int
    attempt: int
    group: int
    first_rank: int
    ranks: int
    shards: list[ShardInfo]


class CheckpointShardsInput(Msg):
    """The shards of ranks ``first_rank`` to ``first_rank + ranks - 1`` of a committed checkpoint."""

    uri: str  # its CheckpointRef's
    first_rank: int
    ranks: int


class LatestCheckpointInput(Msg):
    job_id: str
    prefix: str
    world_size: int
    max_step: int | None = None
    # A fresh run: checkpoints of attempts before this one are an earlier run's (not resumed).
    min_attempt: int | None = None
    # The attempt about to begin, recorded in S3 first: older attempts commit nothing after it.
    attempt: int | None = None


# -- ranks -----------------------------------------------------------------------


class PortInput(Msg):
    job_id: str
    attempt: int


class Endpoint(Msg):
    host: str
    port: int


class RunRanksInput(Msg):
    job_id: str
    workflow_id: str
    # The job run (its first run id, constant across continue-as-new): a resubmitted job counts
    # attempts from 1 again, and must never be handed the previous run's session.
    chain: str = ""
    attempt: int
    node: NodeInfo
    node_index: int
    ranks: list[int]
    spec: JobSpec
    master: Endpoint
    ckpt_prefix: str
    resume: CheckpointRef | None = None
    # Set after continue-as-new: join the ranks already running, never start new ones.
    attach_only: bool = False
    # Rank -> the rank whose checkpoint shard it restores (a replay on fewer replicas).
    restore_from: dict[int, int] = {}
    # Ranks whose resume shard is a peer backup: dst rank -> (rank holding it, sha256).
    restore_peers: dict[int, tuple[int, str]] = {}
    # A diagnostic run (dual-phase replay): nothing is uploaded and no progress is signalled.
    dry_run: bool = False
    # This run's first attempt (attempts are numbered on across runs of the job's name): the
    # ranks' TORCHELASTIC_RESTART_COUNT counts from it. None: 1.
    first_attempt: int | None = None
    # A fresh run of a name used before: saves of attempts before first_attempt are an earlier
    # run's, never restored, and the machine's own copy of the script's checkpoint dir is emptied.
    fresh: bool = False
    # The script's own checkpoints to restore before the ranks start, as the job chose them
    # (``trainguard.domain.restore_point``); empty: the newest complete one per name in S3.
    script_restore: list[ScriptCheckpointRef] = []
    # A large job's first machine: the job's workflow id, which takes its step straight at
    # ``progress_interval_s`` (``report_interval.progress_only``); its group (``workflow_id``)
    # takes its routine reports and news as every other machine's. Empty: every report there.
    progress_to: str = ""


class RankExit(Msg):
    rank: int
    exit_code: int | None
    signal: int | None = None
    stderr_tail: str = ""


class RunRanksResult(Msg):
    node: str
    attempt: int
    ok: bool
    last_step: int = 0
    exits: list[RankExit] = []
    final_hashes: dict[int, str] = {}
    shards: list[ShardInfo] = []
    message: str = ""
    incident: IncidentReport | None = None
    memory: list[ShardInfo] = []  # the newest memory snapshots when the ranks ended
    backups: list[ShardInfo] = []  # other machines' snapshots kept here
    # attach_only found no such ranks here: the agent restarted since it started them.
    gone: bool = False
    # The script's own checkpoints this machine stored that no progress report carried (those of
    # its last look, after the ranks ended, among them).
    script_ckpts: list[ScriptCheckpointRef] = []


class ProgressReport(Msg):
    """What an agent tells the workflow, at a bounded rate, while its ranks run."""

    node: str
    attempt: int
    step: int
    loss: float | None = None
    step_time_s: float | None = None
    first_step_at: datetime | None = None
    at: datetime
    shards: list[ShardInfo] = []
    # Median forward/backward time of this machine's ranks (fail-slow is judged across machines).
    compute_s: float | None = None
    # Parameter hashes of this machine's ranks at ``hash_step`` (replicas must agree).
    hash_step: int | None = None
    hashes: dict[int, str] = {}
    # This machine's newest complete memory snapshots (key ""): restore needs no S3 when every
    # machine still holds the same step.
    memory: list[ShardInfo] = []
    # Seconds training was blocked by checkpoint snapshots this attempt (slowest local rank per step).
    ckpt_block_s: float = 0.0
    # Other machines' snapshots this machine keeps (``rank`` is the rank they belong to).
    backups: list[ShardInfo] = []
    # Step time lost to snapshots this attempt beyond the blocking above (slowest local rank).
    protection_s: float = 0.0
    # The memory-snapshot interval the ranks agreed on (a cost budget), and a snapshot's cost.
    snapshot_every: int | None = None
    snapshot_cost_s: float | None = None
    # A snapshot's time from hand-over to stored: a failure within it loses the interval before.
    snapshot_settle_s: float | None = None
    # Steps between S3 persists the ranks derived with the interval (a multiple of it).
    snapshot_persist_every: int | None = None
    # The script's own checkpoints this machine stored since its last report.
    script_ckpts: list[ScriptCheckpointRef] = []
    # Warm rank processes preloaded and waiting on this machine (None: an agent without a pool).
    warm_ready: int | None = None
    # The attempt failed here: its incident, sent as soon as it is raised. The machine's result
    # carries it again once the end's work is done (ranks stopped, pipes read, the script's
    # checkpoints stored, the hardware probed): seconds later on a loaded machine, by when a
    # peer's effect (a broken collective) must not have been taken for the cause.
    incident: IncidentReport | None = None


# -- groups of a large job's machines (workflows.job.group) ------------------------


class GroupInput(Msg):
    """One group of a large job's machines, for one attempt: start (or, ``attach``, wait for)
    their ranks, keep what each machine reports, and tell the job what it must know."""

    parent: str  # the job's workflow id: where the group's news goes (any run of it)
    group: int
    first_index: int  # node_index of nodes[0]
    nodes: list[NodeInfo]
    # The run_ranks input of every machine but its own parts (node, node_index, ranks and resume
    # shards are filled in per machine; every machine gets every peer restore: its holders send
    # what the others receive); ``resume.shards`` holds the group's ranks'.
    ranks_input: RunRanksInput
    schedule_to_start_s: float
    heartbeat_timeout_s: float
    # A machine asked to re-attach after missing heartbeats must pick it up within this.
    pickup_s: float
    # Routine summaries to the job at most this often (news goes at once).
    summary_every_s: float
    # The job's first machine (if this group has it) sends its step to the job itself
    # (``RunRanksInput.progress_to``): no group tells the job at the progress rate.
    step_to_job: bool = False
    # A group that continued as new (its history grew long): its machines' ranks run on, to be
    # re-attached; and what it knew of them.
    attach: bool = False
    first_step_sent: bool = False
    compute: dict[str, float] = {}
    block: dict[str, tuple[float, float]] = {}


class GroupStop(Msg):
    """The job stops the group's ranks (a failure elsewhere, a user's stop, a code update)."""

    persist: bool = False
    # A user's stop waits this long for the uploads of the persist (seconds).
    limit_s: float | None = None
    # The job ends (StopRanksInput.final).
    final: bool = False


class ReplicaRun(Msg):
    """Consecutive data-parallel replicas (``first_dp``..``last_dp``) of one model position whose
    parameters hash alike: a group's replica hashes without one entry per rank."""

    position: int
    first_dp: int
    last_dp: int
    hash: str


class GroupNews(Msg):
    """What a group tells the job: its progress (a summary), a machine that failed, a complete
    part of a checkpoint, and, once every machine ended, every machine's result."""

    group: int
    attempt: int
    at: datetime
    # The group's summary: step, loss and step time of its most advanced report, its first step,
    # checkpoint blocking and protection (its slowest machine's), the agreed snapshot interval.
    progress: ProgressReport | None = None
    # The fastest and slowest machine's compute time per step (fail-slow) and how many machines
    # of the group reported one.
    compute: dict[str, float] = {}
    computed: int = 0
    hash_step: int | None = None
    replicas: list[ReplicaRun] = []
    parts: list[PartRef] = []
    # Machines that ended with a failure since the group's last news, and those whose run_ranks
    # failed (lost, with the error); machines still running and heard from.
    failed: list[RunRanksResult] = []
    # Incidents machines raised since the group's last news (ProgressReport.incident): their
    # results follow once their end's work is done.
    raised: list[IncidentReport] = []
    lost: dict[str, str] = {}
    running: int = 0
    # Every machine ended: each one's result (their memory snapshots and backups name the
    # restore point), and those cut off (missed heartbeats, answered neither re-attach nor stop).
    done: bool = False
    results: list[RunRanksResult] = []
    cut_off: list[str] = []


# -- drills and incidents ---------------------------------------------------------

RANK_FAULTS = ("crash", "hang", "nan", "loss-spike", "slow", "sdc")
MACHINE_FAULTS = ("gpu-lost", "gpu-xid", "ecc", "nic-down", "nic-flap", "disk-full")
ALL_FAULTS = (*RANK_FAULTS, *MACHINE_FAULTS, "agent-kill")


class InjectInput(Msg):
    node: str = Field(pattern=NODE_NAME_RE)
    fault: Literal[ALL_FAULTS]  # type: ignore[valid-type]
    rank: int | None = Field(default=None, ge=0, le=1 << 20)
    at_step: int | None = Field(default=None, ge=1, le=1_000_000_000)
    # How many times a one-shot fault acts; nic-flap: how many flaps (default 1, which the
    # tolerance absorbs).
    count: int | None = Field(default=None, ge=1, le=100_000)
    # Real-NIC drills (agent run with --nic): how long nic-down keeps the link down before the
    # agent restores it itself (default 20 s), or each nic-flap's down time (default 1 s).
    duration_s: float | None = Field(default=None, gt=0, le=3600)
    # The fault shows only under training load: stop-time checks do not see it, so only a
    # reattempt, a rollback and the dual-phase replay can find it (drills of those rungs).
    evades_checks: bool = False


class InjectResult(Msg):
    node: str
    fault: str
    fault_id: str
    injected_at: datetime


class ClearFaultsInput(Msg):
    node: str


class StackInput(Msg):
    job_id: str
    attempt: int
    # S3 key prefix for the dumps (under the job's checkpoint prefix).
    prefix: str


class StackDump(Msg):
    node: str
    uri: str | None = None
    ranks: list[int] = []
    error: str = ""


class LocalizeStacksInput(Msg):
    dumps: list[StackDump]
    topology: Topology
    ranks_per_node: int
    nodes: list[str]  # the job's machines in rank-block order


class StackFinding(Msg):
    machines: list[str] = []
    evidence: str


class StopRanksInput(Msg):
    job_id: str
    attempt: int
    # The job run (RunRanksInput.chain): a stop that arrives before its attempt's ranks is kept
    # for them, and must not stop a later run's attempt of the same number.
    chain: str = ""
    # A user's stop: the machine's newest memory snapshots not in S3 yet go there before the
    # answer, and a last progress report names their shards (the job's last checkpoint is then
    # the newest step every machine held, not the last periodic persist).
    persist: bool = False
    # The job ends (a user's stop or cancel): no next attempt runs here, so the machine starts no
    # processes for one.
    final: bool = False


# -- fan-out of one activity over many machines (workflows.job.fanout) ------------


class FanOutCall(Msg):
    node: NodeInfo
    arg: Any  # the activity's input, as JSON


class FanOutInput(Msg):
    activity: str  # its name in the activity contract
    calls: list[FanOutCall]
    # Options passed to every call (schedule_to_start, start_to_close, heartbeat), in seconds.
    timeouts_s: dict[str, float] = {}


class FanOutResult(Msg):
    """Each machine's answer (as JSON), or the error it gave."""

    answers: dict[str, Any] = {}
    errors: dict[str, str] = {}


# A stop-time check process must say it is ready (Python started, torch imported) within this;
# its budget (``timeout_s``) counts from then: two processes importing torch on a loaded 2-core
# machine took most of a minute.
CHECK_START_BOUND_S = 120.0
# A pair's side waits for a partner still starting as long as its own start took, at most this.
CHECK_PEER_GRACE_MAX_S = 60.0
# After a check's budget: its arithmetic, its answer and the group's teardown.
CHECK_MARGIN_S = 30.0


class DiagnosticInput(Msg):
    job_id: str
    attempt: int
    # Ranks per machine: the intra-machine collective test runs that many processes.
    local_world: int = Field(1, ge=1, le=64)
    timeout_s: float = Field(20.0, gt=0, le=600)


class PairTestInput(Msg):
    """One machine's side of a pairwise inter-machine check (rank 0 hosts the rendezvous)."""

    job_id: str
    attempt: int
    rank: int = Field(ge=0, le=1)
    master: Endpoint
    timeout_s: float = Field(15.0, gt=0, le=600)


class CheckResult(Msg):
    node: str
    passed: bool
    digest: str | None = None
    # The exact answer the digest should equal (alignment test).
    reference: str | None = None
    evidence: str = ""
    elapsed_s: float | None = None


class IncidentReport(Msg):
    """What a machine saw when it ended its ranks' attempt: the first confirmed anomaly."""

    kind: str
    node: str
    # Machines that may be at fault, when the report cannot name one (default: ``node``).
    suspects: list[str] = []
    ranks: list[int] = []
    evidence: str
    confidence: float = 0.5
    # The anomaly started on this machine (vs. seen here as a consequence, e.g. after an all-reduce).
    origin: bool = False
    detected_at: datetime
    fault_at: datetime | None = None
    error_class: str | None = None
    user_code: bool = False
    code_location: str | None = None
    step: int | None = None
    # Every rank on this machine had loaded the checkpoint it was started from: a failure after
    # that is not the checkpoint's fault.
    restored: bool = False
    # The output of the rank it reports, uploaded by the machine (trainguard.domain.rank_logs).
    log_uri: str | None = None


RunRanksResult.model_rebuild()
PoolState.model_rebuild()
GroupNews.model_rebuild()
