"""The environment contract between the node agent and the ranks it starts.

The agent writes these variables (``rank_env``); the in-rank runtime reads them
(``RankEnv.from_environ``). Keeping both sides in one module keeps them in step.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict

from trainguard.domain.checkpoints import step_dir_name
from trainguard.domain.spec import Topology

REPORT_FD = "TG_REPORT_FD"
# What a node agent holds that no rank may see: its S3 and Temporal credentials (Temporal's own
# TEMPORAL_* configuration: an API key, a profile), the payload key, its telemetry exporter's
# headers (OTEL_*: an ingest token) and its own configuration. Rank processes never inherit
# these (their initial environment, /proc/<pid>/environ, included).
AGENT_PRIVATE_PREFIXES = ("TRAINGUARD_", "AWS_", "TG_", "TEMPORAL_", "OTEL_")


# NCCL's error handling in every rank unless the agent's or the job's environment says otherwise.
# A collective that fails or passes its timeout (init_process_group's `timeout`: 10 min by default,
# tg.init's `timeout_s`) ends the process at once, without first aborting the communicator, which can
# hang (3: torch's own default since 2.2, set here so an older torch or a site default does not turn
# it off): the agent then sees a rank exit instead of a hung job. The watchdog's monitor kills a rank
# whose watchdog itself is stuck. trainguard's own hang detection acts in seconds, long before these
# timeouts; they are the backstop for a rank the agent cannot reach.
NCCL_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    "TORCH_NCCL_ENABLE_MONITORING": "1",
}


def inheritable_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The agent's environment less its private variables."""
    e = os.environ if environ is None else environ
    return {k: v for k, v in e.items() if not k.startswith(AGENT_PRIVATE_PREFIXES)}


def rank_base_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The base of every rank's environment (the job's own ``env`` goes over it): the agent's
    inheritable environment over :data:`NCCL_DEFAULTS`."""
    return {**NCCL_DEFAULTS, **inheritable_environ(environ)}


class RankEnv(BaseModel):
    model_config = ConfigDict(frozen=True)

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    job: str = "local"
    attempt: int = 0
    node: str = "local"
    topology: Topology
    target_steps: int | None = None  # None: the job runs until its ranks exit
    ckpt_dir: str
    ckpt_every: int
    # Above 0: ckpt_every is only the first interval; the ranks agree on one that costs at most
    # this share of step time (trainguard.domain.protection), at most ``max_lost_s`` of training,
    # and divides (or is a multiple of) the S3 interval ``persist_every``; of those snapshots, S3
    # gets one each ``persist_every_s`` of training (trainguard.domain.protection.persist_stride).
    ckpt_budget: float = 0.0
    max_lost_s: float = 10.0
    persist_every: int = 1
    persist_every_s: float = 0.0
    resume_step: int | None = None
    code_version: str = "v1"
    report_fd: int | None = None
    fault_file: str | None = None
    # Report a parameter hash every N steps (0: never) so replicas can be compared.
    hash_every: int = 0
    # Send each snapshot to this rank's backup rank on another machine (0: never; every N snapshots).
    backup: bool = False
    # Ranks whose resume shard is a backup held on another machine: dst rank -> (src rank, sha256).
    restore_peers: dict[int, tuple[int, str]] = {}
    # torchrun's view: this machine's index among the job's machines, their count, how many
    # times the job restarted (attempt - 1) and may restart.
    node_rank: int = 0
    nnodes: int = 1
    restart_count: int = 0
    max_restarts: int = 0
    # Where the script keeps its own checkpoints on this machine (absolute; ``--checkpoint-dir``).
    script_ckpt_dir: str | None = None
    # How long tg.init waits for the job's process group to form (None: its collective timeout).
    rendezvous_timeout_s: float | None = None

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> RankEnv:
        e = os.environ if env is None else env
        world = int(e.get("WORLD_SIZE", "1"))
        topo = Topology(
            tp=int(e.get("TG_TP", "1")),
            pp=int(e.get("TG_PP", "1")),
            dp=int(e.get("TG_DP", str(world // (int(e.get("TG_TP", "1")) * int(e.get("TG_PP", "1")))))),
        )
        resume = e.get("TG_RESUME_STEP", "")
        fd = e.get(REPORT_FD, "")
        return cls(
            rank=int(e.get("RANK", "0")),
            world_size=world,
            local_rank=int(e.get("LOCAL_RANK", "0")),
            local_world_size=int(e.get("LOCAL_WORLD_SIZE", "1")),
            master_addr=e.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(e.get("MASTER_PORT", "29500")),
            job=e.get("TG_JOB", "local"),
            attempt=int(e.get("TG_ATTEMPT", "0")),
            node=e.get("TG_NODE", "local"),
            topology=topo,
            target_steps=int(e.get("TG_TARGET_STEPS", "100")),
            ckpt_dir=e.get("TG_CKPT_DIR", "checkpoints"),
            ckpt_every=int(e.get("TG_CKPT_EVERY", "10")),
            ckpt_budget=float(e.get("TG_CKPT_BUDGET", "0")),
            max_lost_s=float(e.get("TG_MAX_LOST_S", "10")),
            persist_every=int(e.get("TG_PERSIST_EVERY", "1")),
            persist_every_s=float(e.get("TG_PERSIST_EVERY_S", "0")),
            resume_step=int(resume) if resume else None,
            code_version=e.get("TG_CODE_VERSION", "v1"),
            report_fd=int(fd) if fd else None,
            fault_file=e.get("TG_FAULT_FILE") or None,
            hash_every=int(e.get("TG_HASH_EVERY", "0")),
            backup=e.get("TG_BACKUP", "") == "1",
            node_rank=int(e.get("GROUP_RANK", "0")),
            nnodes=int(e.get("GROUP_WORLD_SIZE", "1")),
            restart_count=int(e.get("TORCHELASTIC_RESTART_COUNT", "0")),
            max_restarts=int(e.get("TORCHELASTIC_MAX_RESTARTS", "0")),
            script_ckpt_dir=e.get("TG_CHECKPOINT_DIR") or None,
            rendezvous_timeout_s=float(rdv) if (rdv := e.get("TG_RENDEZVOUS_TIMEOUT_S")) else None,
            restore_peers={
                int(k): (int(v[0]), str(v[1]))
                for k, v in json.loads(e.get("TG_RESTORE_PEERS") or "{}").items()
            },
        )

    def to_environ(self) -> dict[str, str]:
        out = {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            # torchrun's rank environment (torch.distributed.elastic), so scripts written for it
            # behave as there; not TORCHELASTIC_USE_AGENT_STORE: no agent serves a store here.
            "GROUP_RANK": str(self.node_rank),
            "NODE_RANK": str(self.node_rank),
            "GROUP_WORLD_SIZE": str(self.nnodes),
            "ROLE_NAME": "default",
            "ROLE_RANK": str(self.rank),
            "ROLE_WORLD_SIZE": str(self.world_size),
            "TORCHELASTIC_RESTART_COUNT": str(self.restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts),
            "TORCHELASTIC_RUN_ID": self.job,
            "TG_JOB": self.job,
            "TG_ATTEMPT": str(self.attempt),
            "TG_NODE": self.node,
            "TG_TP": str(self.topology.tp),
            "TG_PP": str(self.topology.pp),
            "TG_DP": str(self.topology.dp),
            "TG_CKPT_DIR": self.ckpt_dir,
            "TG_CKPT_EVERY": str(self.ckpt_every),
            "TG_CODE_VERSION": self.code_version,
        }
        if self.target_steps is not None:
            out["TG_TARGET_STEPS"] = str(self.target_steps)
        if self.resume_step is not None:
            out["TG_RESUME_STEP"] = str(self.resume_step)
        if self.report_fd is not None:
            out[REPORT_FD] = str(self.report_fd)
        if self.fault_file:
            out["TG_FAULT_FILE"] = self.fault_file
        if self.ckpt_budget:
            out["TG_CKPT_BUDGET"] = str(self.ckpt_budget)
            out["TG_MAX_LOST_S"] = str(self.max_lost_s)
            out["TG_PERSIST_EVERY"] = str(self.persist_every)
            out["TG_PERSIST_EVERY_S"] = str(self.persist_every_s)
        if self.hash_every:
            out["TG_HASH_EVERY"] = str(self.hash_every)
        if self.backup:
            out["TG_BACKUP"] = "1"
        if self.script_ckpt_dir:
            out["TG_CHECKPOINT_DIR"] = self.script_ckpt_dir
        if self.rendezvous_timeout_s is not None:
            out["TG_RENDEZVOUS_TIMEOUT_S"] = str(self.rendezvous_timeout_s)
        if self.restore_peers:
            out["TG_RESTORE_PEERS"] = json.dumps({str(k): list(v) for k, v in self.restore_peers.items()})
        return out


def backup_shard_name(step: int, of_rank: int) -> str:
    """Relative path (in the receiving machine's snapshot dir) of another machine's rank's backup."""
    return f"backup/{step_dir_name(step)}/rank-{of_rank:05d}.pt"
