"""Node agent: one per machine, a Temporal worker on that machine's own task queue.

It registers the machine with the node pool, then takes work only from its
queue (``node-<name>``): start and watch ranks, and later probe health, keep
checkpoint copies and run diagnostics. It listens on no port of its own.

    python -P -m workers.node_agent --name node-1 --workdir /var/lib/trainguard --host 10.0.0.17

``-P`` keeps the directory it is started in off the import path (``workers/__init__.py`` drops
it too): a user's own ``activities`` or ``workflows`` package there never stands in for ours.
``--host`` is the address the job's other machines reach this one at (its ranks rendezvous
there); the default, 127.0.0.1, serves only machines on this host (the local stack).

``--nic IF`` hands the agent a real interface that drills may take down (the
netns mode of the local stack: each machine in its own network namespace). A
link probe then watches it, and nic-down / nic-flap drills act on the link
itself; see ``activities.drills``.

``--rank-user USER`` (root only) starts every rank as that unprivileged user
(``trainguard.agent.rank_user``); what ranks may reach then lives in ``--rank-dir``
(default: the work dir), each of whose ancestors that user must be able to
enter, while the agent's own work dir may be private. ``<workdir>/jobs`` then
links to ``<rank dir>/jobs``, so a machine's job files are found where they were.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import importlib.util
import logging
import os
import re
import shutil
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from temporalio.worker import Worker

from activities.diagnostics import DiagnosticActivities
from activities.drills import DrillActivities, DrillProbe, DrillState, LinkControl
from activities.fence import Fence, temporal_probe
from activities.health import HealthMonitor
from activities.isolation import RankIsolation
from activities.rank_logs import LogActivities
from activities.ranks import RankActivities
from activities.session import Sessions
from activities.stacks import StackActivities
from activities.warm_memory import MEMORY_FRACTION
from activities.warm_pool import AUTO, WarmPool
from trainguard.agent.health.events import Probe
from trainguard.agent.health.host import HostProbe
from trainguard.agent.health.link import LinkProbe
from trainguard.agent.health.nvml import NvmlProbe, count_gpus
from trainguard.agent.rank_user import (
    RankUser,
    RankUserError,
    rank_preexec,
    reachable,
    readable_by_others,
    shared_dir,
)
from trainguard.domain.fencing import HEARTBEAT_THROTTLE_S
from trainguard.domain.messages import NODE_NAME_RE, NodeInfo, node_queue
from trainguard.services import pool_client, sealed, telemetry
from trainguard.services.settings import Settings
from trainguard.services.storage import JobStores
from trainguard.services.temporal import connect
from workers.common import add_metrics_port, run_until_signalled, setup_logging, start_metrics
from workers.memory_trace import trace_memory_if_asked

# The server's view of a run_ranks heartbeat is never older than this when the link goes: part of
# the lost bound the agent's fence must beat (trainguard.domain.fencing).
HEARTBEAT_THROTTLE = timedelta(seconds=HEARTBEAT_THROTTLE_S)
# Checkpoint snapshots go to tmpfs only when it has this much room; else to the work disk.
MEMORY_MIN_FREE_BYTES = 1 << 30
MEMORY_DIR_RECORD = "memory_dir"
LEAVE_TIMEOUT_S = 5.0

log = logging.getLogger(__name__)


def memory_dir_for(workdir: Path, shm: Path = Path("/dev/shm"), rank_dir: Path | None = None) -> Path:
    """Where this machine keeps its ranks' per-step snapshots: memory (tmpfs) when there is
    room, else the work disk (the rank dir's). The choice is recorded in the work dir so
    teardown can find it."""
    try:
        roomy = (
            shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free >= MEMORY_MIN_FREE_BYTES
        )
    except OSError:
        roomy = False
    # One directory per work dir: several local stacks may run machines of the same name.
    tag = hashlib.sha1(str(workdir).encode()).hexdigest()[:12]
    path = shm / "trainguard" / tag if roomy else (rank_dir or workdir) / "memory"
    path.mkdir(parents=True, exist_ok=True)
    (workdir / MEMORY_DIR_RECORD).write_text(str(path))
    return path


async def main(
    name: str,
    workdir: Path,
    code_dir: Path,
    host: str,
    gpus: int,
    rank_nice: int,
    nic: str | None = None,
    warm_ranks: int = AUTO,
    pool: str | None = None,
    metrics_port: int | None = None,
    user: RankUser | None = None,
    rank_dir: Path | None = None,
    warm_memory: float = MEMORY_FRACTION,
) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    rank_dir = rank_dir or workdir
    memory_dir = memory_dir_for(workdir, rank_dir=rank_dir)
    # The standing faults are read by the ranks: beside what they may reach.
    drills = DrillState(rank_dir, name)
    drill = DrillActivities(drills, LinkControl(nic, workdir) if nic else None)
    await drill.restore_link()  # before connecting: a link left down would keep us offline
    settings = Settings.load()
    machine_key = sealed.private_key(text) if (text := settings.secret_key_text()) else None
    endpoint = await start_metrics(metrics_port)
    telemetry.setup(
        settings,
        "trainguard-agent",
        {"service.instance.id": name},
        metric_readers=[endpoint.reader] if endpoint else (),
    )
    # The client's TracingInterceptor applies to this worker too: its activities are traced.
    client = await connect(settings, endpoint.runtime if endpoint else None)
    pool = pool or settings.pool
    # The agent's parts, each built on those before it: the sessions first, which the host
    # probe, the rank output, the stack dumps, the fence, the warm pool (held back while ranks
    # start) and the shutdown all read.
    sessions = Sessions()
    machine_probes = probes(name, [workdir, memory_dir], drills, gpus, sessions.rank_pids, nic)
    health = HealthMonitor(machine_probes)
    health.start()
    stores = JobStores(settings)  # each job's files through credentials of its own
    found_gpus = gpus or count_gpus()
    warm = WarmPool(
        warm_ranks,
        workdir / "warm",
        functools.partial(rank_preexec, rank_nice, user),
        hold=sessions.starting,
        gpus=found_gpus,
        fraction=warm_memory,
        user=user,
        nice=rank_nice,
    )
    isolation = RankIsolation(user, rank_dir, memory_dir, sessions, warm)
    await isolation.startup()  # before the warm processes: it kills every process of the rank user
    warm.start()
    info = NodeInfo(
        name=name,
        task_queue=node_queue(name, pool),
        host=host,
        gpus=found_gpus,
        cpus=len(os.sched_getaffinity(0)),
        sealing_key=sealed.public_text(machine_key) if machine_key else None,
        warm_ranks=warm.target(),
    )
    logs = LogActivities(name, stores, sessions)
    ranks = RankActivities(
        client, stores, rank_dir, code_dir, host, health, drills, sessions, logs,
        rank_nice=rank_nice, node_name=name, memory_dir=memory_dir, warm=warm, machine_key=machine_key,
        user=user, isolation=isolation,
    )  # fmt: skip
    stacks = StackActivities(node_name=name, sessions=sessions, stores=stores)
    diagnostics = DiagnosticActivities(name, health, drills)
    worker = Worker(
        client,
        task_queue=info.task_queue,
        activities=[
            ranks.run_ranks,
            ranks.pick_master_port,
            drill.inject_fault,
            drill.clear_faults,
            ranks.stop_ranks,
            stacks.dump_stacks,
            logs.tail_logs,
            diagnostics.self_test,
            diagnostics.alignment_test,
            diagnostics.collective_test,
            diagnostics.pair_test,
        ],
        identity=f"agent-{name}@{os.getpid()}",
        max_concurrent_activities=16,
        graceful_shutdown_timeout=timedelta(seconds=5),
        max_heartbeat_throttle_interval=HEARTBEAT_THROTTLE,
    )
    fence = asyncio.create_task(Fence(temporal_probe(client), sessions).run(), name="fence")

    # Poll first, then register: once the pool lists this machine, work sent to its
    # queue is picked up at once.
    async def leave() -> None:
        # Off the pool before the queue goes quiet: no job is handed a machine nobody serves.
        try:
            await asyncio.wait_for(pool_client.deregister(client, name, pool), LEAVE_TIMEOUT_S)
        except Exception as exc:  # no controller answering: the pool notices the silence later
            log.warning("could not leave the pool: %s", exc)

    running = asyncio.create_task(run_until_signalled(worker, sessions.running, leave))
    try:
        await pool_client.register(client, info, pool=pool)
        await running
    finally:
        fence.cancel()
        await warm.stop()
        await health.stop()


def prepare_rank_dir(workdir: Path, rank_dir: Path, user: RankUser | None) -> Path:
    """The directory of what ranks may reach (their jobs' files, the standing faults): with a
    rank user, root's and enterable by that user (RankUserError naming the directory that stops
    it); ``<workdir>/jobs`` links to its ``jobs`` when it is elsewhere."""
    rank_dir = rank_dir.resolve()
    rank_dir.mkdir(parents=True, exist_ok=True)
    if user is not None:
        shared_dir(rank_dir)
        stop = reachable(rank_dir, user)
        if stop is not None:
            raise RankUserError(f"--rank-dir: user {user.name} cannot enter {stop} ({rank_dir})")
    jobs, link = rank_dir / "jobs", workdir / "jobs"
    if rank_dir != workdir.resolve() and not link.exists() and not link.is_symlink():
        jobs.mkdir(exist_ok=True)
        link.symlink_to(jobs)
    return rank_dir


def credential_files(settings: Settings) -> list[Path]:
    """The files this agent's credentials are read from (none may be readable by a rank)."""
    named = [
        settings.payload_key_file,
        settings.temporal_tls_key,
        os.environ.get("TEMPORAL_CONFIG_FILE"),
        str(settings.state_dir / "stack.json"),
    ]
    return [Path(p).expanduser() for p in named if p]


RankPids = Callable[[], dict[int, int]]


def probes(
    name: str, dirs: list[Path], drills: DrillState, gpus: int, rank_pids: RankPids, nic: str | None = None
) -> list[Probe]:
    """Every health provider this machine runs; NVML says once if it cannot run here.

    With a real NIC the link probe reports link faults and the drill probe does not fake them.
    """
    out: list[Probe] = [
        DrillProbe(drills, real_link=nic is not None),
        NvmlProbe(name, expected_gpus=gpus or None),
        HostProbe(name, dirs, min_free_bytes=512 << 20, min_free_fraction=0.005, rank_pids=rank_pids),
    ]
    if nic is not None:
        out.append(LinkProbe(name, nic))
    return out


def node_name(text: str) -> str:
    """argparse type: a machine name (it becomes a task queue and directory name)."""
    if not re.fullmatch(NODE_NAME_RE, text):
        raise argparse.ArgumentTypeError("letters, digits, '.', '_', '-'; 1-63 characters")
    return text


def warm_ranks(text: str) -> int:
    """argparse type: ``auto`` or a count of warm rank processes."""
    if text == "auto":
        return AUTO
    if not text.isdigit() or int(text) > 64:
        raise argparse.ArgumentTypeError("auto, or a whole number from 0 to 64")
    return int(text)


def fraction(text: str) -> float:
    """argparse type: a share, above 0 and at most 1."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError("a number above 0 and at most 1")
    return value


def parser() -> argparse.ArgumentParser:
    """The agent's command line (the deployment recipes' tests parse theirs with it)."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--name", type=node_name, required=True, help="machine name, unique in the cluster")
    p.add_argument("--workdir", type=Path, required=True, help="local dir: rank logs, checkpoints")
    p.add_argument("--code-dir", type=Path, default=Path.cwd(), help="directory ranks run in")
    p.add_argument("--host", default="127.0.0.1", help="address peers use to reach this machine")
    p.add_argument("--gpus", type=int, default=0, help="GPUs expected on this machine (0: as found)")
    p.add_argument("--rank-nice", type=int, default=0, help="niceness of ranks (shared local hosts)")
    p.add_argument(
        "--nic",
        default=None,
        help="this machine's NIC, a real interface link drills may take down (netns local stack)",
    )
    p.add_argument(
        "--warm-ranks",
        type=warm_ranks,
        default=AUTO,
        metavar="auto|N",
        help="rank processes kept started (torch imported, at idle CPU priority) for fast restarts; "
        "auto (default): two starts of a rank per GPU (of 2 ranks without GPUs; more when a job runs "
        "more ranks here), within --warm-memory; 0: none",
    )
    p.add_argument(
        "--warm-memory",
        type=fraction,
        default=MEMORY_FRACTION,
        metavar="FRACTION",
        help=f"share of the machine's memory warm rank processes may hold (default {MEMORY_FRACTION})",
    )
    p.add_argument(
        "--pool",
        type=node_name,
        default=None,
        help="the pool to join, one per cluster or allocation (default: TRAINGUARD_POOL or trainguard-pool)",
    )
    p.add_argument(
        "--rank-user",
        default=os.environ.get("TRAINGUARD_RANK_USER") or None,
        help="start ranks as this unprivileged user (root only; one per pool; default TRAINGUARD_RANK_USER)",
    )
    p.add_argument(
        "--rank-netns",
        type=Path,
        default=None,
        help="with --rank-user: a network namespace (a path such as /run/netns/NAME) to start ranks in",
    )
    p.add_argument(
        "--rank-host",
        type=Path,
        default=None,
        help="with --rank-user: the socket of a rank host that starts the ranks in a container of "
        "their own (python -m trainguard.agent.rank_host)",
    )
    p.add_argument(
        "--rank-dir",
        type=Path,
        default=None,
        help="where ranks' files live, enterable by the rank user (default: the work dir)",
    )
    add_metrics_port(p)
    return p


def cli() -> None:
    p = parser()
    args = p.parse_args()
    if importlib.util.find_spec("torch") is None:  # the ranks and the self-test train with it
        p.exit(
            1,
            "error: the node agent needs torch, which comes with the 'agent' extra: "
            "pip install 'trainguard[agent]'\n",
        )
    workdir = args.workdir.resolve()
    user = None
    try:
        if args.rank_user:
            user = RankUser.lookup(args.rank_user, args.rank_netns, args.rank_host)
            exposed = readable_by_others(credential_files(Settings.load()))
            if exposed:
                raise RankUserError(f"credentials the ranks could read: {', '.join(exposed)}; chmod 600")
        elif args.rank_host or args.rank_netns:
            raise RankUserError("--rank-host and --rank-netns need --rank-user")
        workdir.mkdir(parents=True, exist_ok=True)
        rank_dir = prepare_rank_dir(workdir, args.rank_dir or workdir, user)
    except RankUserError as exc:
        p.exit(1, f"error: {exc}\n")
    setup_logging(f"agent-{args.name}")
    trace_memory_if_asked(f"agent-{args.name}")
    asyncio.run(
        main(
            args.name,
            workdir,
            args.code_dir.resolve(),
            args.host,
            args.gpus,
            args.rank_nice,
            args.nic,
            args.warm_ranks,
            args.pool,
            args.metrics_port,
            user,
            rank_dir,
            args.warm_memory,
        )
    )


if __name__ == "__main__":
    cli()
