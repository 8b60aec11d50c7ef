"""Slurm operator calls: drain and resume machines, and read what Slurm says of them.

Only the pool's Slurm worker (``workers/slurm.py``) runs these, on a host whose user may
run ``scontrol update`` (a Slurm operator or administrator); agents never need those rights.
Slurm's own client configuration applies (``SLURM_CONF`` and the rest of the environment).
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Mapping

from temporalio import activity
from temporalio.exceptions import ApplicationError

from trainguard.contract import calls
from trainguard.domain.messages import SlurmNodeInput, SlurmReplacementInput

SLURM_TIMEOUT_S = 20.0


class SlurmControl:
    """``scontrol`` and ``sinfo`` of one cluster (the environment picks it: ``SLURM_CONF``)."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.env = dict(env) if env is not None else None

    def _run(self, *argv: str) -> str:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, env=self.env, timeout=SLURM_TIMEOUT_S, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv[:3])} failed ({done.returncode}): {done.stderr.strip()[-500:]}"
            )
        return done.stdout

    def drain(self, node: str, reason: str) -> None:
        # One argv element: the reason's spaces need no quoting, nothing passes through a shell.
        self._run("scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}")

    def resume(self, node: str) -> None:
        self._run("scontrol", "update", f"NodeName={node}", "State=RESUME")

    def submit_agent(self, script: str, exclude: list[str]) -> str:
        """``sbatch`` one more node of agents (``script``, e.g. trainguard-agents.sbatch) kept off
        ``exclude``; returns Slurm's job id. The submitting environment (the pool's settings)
        goes with it."""
        argv = ["sbatch", "--parsable", "-N1", "--export=ALL"]
        if exclude:
            argv.append(f"--exclude={','.join(exclude)}")
        return self._run(*argv, script).strip().split(";")[0]

    def drains(self) -> dict[str, str | None]:
        """Every node -> its drain reason, or None when it is not drained (or draining)."""
        out: dict[str, str | None] = {}
        for line in self._run("sinfo", "--noheader", "--Node", "--format=%N|%T|%E").splitlines():
            name, state, reason = [*line.split("|", 2), "", ""][:3]
            if name.strip():
                drained = "drain" in state.lower()
                out[name.strip()] = (reason.strip() or "drained") if drained else None
        return out


class SlurmActivities:
    def __init__(self, slurm: SlurmControl, agent_script: str | None = None) -> None:
        self.slurm = slurm
        self.agent_script = agent_script

    @activity.defn(name=calls.slurm_request_node.name)
    async def slurm_request_node(self, req: SlurmReplacementInput) -> str:
        if self.agent_script is None:
            raise ApplicationError("this Slurm worker has no --agent-script", non_retryable=True)
        try:
            job = await asyncio.to_thread(self.slurm.submit_agent, self.agent_script, req.exclude)
        except RuntimeError as exc:
            raise ApplicationError(str(exc), type="SlurmError") from None
        activity.logger.info("submitted replacement agent job %s (excluding %s)", job, req.exclude)
        return job

    @activity.defn(name=calls.slurm_node.name)
    async def slurm_node(self, req: SlurmNodeInput) -> bool:
        try:
            if req.drain:
                await asyncio.to_thread(self.slurm.drain, req.node, req.reason)
            else:
                await asyncio.to_thread(self.slurm.resume, req.node)
        except RuntimeError as exc:
            raise ApplicationError(str(exc), type="SlurmError") from None
        activity.logger.info("%s %s in Slurm", "drained" if req.drain else "resumed", req.node)
        return True
