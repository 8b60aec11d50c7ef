"""The Slurm side of NodePoolWorkflow: quarantine and Slurm's drain state never disagree.

A pool with a Slurm worker attached (``workers/slurm.py``, the one place with Slurm
operator rights, on its own task queue) drains its quarantined machines in Slurm, with the
evidence as the reason, and resumes those that leave quarantine (a passed retest,
``trainguard nodes release``). The worker polls Slurm and reports what it sees: an
operator's drain takes the machine out of service (quarantined once no job holds it,
not retested) until an operator resumes it in Slurm or releases it in trainguard.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError

from trainguard.contract import calls

with workflow.unsafe.imports_passed_through():
    from trainguard.domain.messages import (
        PoolNode,
        PoolState,
        SlurmAttach,
        SlurmNodeInput,
        SlurmObservation,
        SlurmReplacementInput,
    )

PATCH_SLURM = "pool-slurm-sync"
SLURM_REASON_PREFIX = "trainguard: "
SLURM_RETRY = timedelta(seconds=30)


def _order(name: str) -> tuple[int, str]:
    """node-2 before node-10: natural order keeps placement stable and readable."""
    digits = "".join(c for c in name if c.isdigit())
    return (int(digits) if digits else 0, name)


def slurm_change(n: PoolNode, held: bool, drained: bool) -> SlurmNodeInput | None:
    """The drain or resume Slurm needs so that exactly the quarantined (and operator-held)
    machines are drained; lost machines stay as they are."""
    if n.state == "lost":
        return None
    want = n.state == "quarantined" or held
    if want and not drained:
        reason = SLURM_REASON_PREFIX + (n.reason or "quarantined")
        return SlurmNodeInput(node=n.info.name, drain=True, reason=reason[:200])
    if not want and drained:
        return SlurmNodeInput(node=n.info.name, drain=False)
    return None


async def request_replacement(queue: str, exclude: list[str]) -> None:
    """One more agent job from the pool's Slurm worker (a failure is logged: asked again later)."""
    try:
        job = await calls.slurm_request_node(
            SlurmReplacementInput(exclude=exclude), task_queue=queue, summary="replacement node"
        )
        workflow.logger.info("asked Slurm for a replacement node: job %s", job)
    except ActivityError as err:
        workflow.logger.warning("no replacement node requested: %s", err.cause or err)


class SlurmSync:
    """Mixed into the unsharded pool (``workflows/pool_legacy.py``), whose state it reads and
    changes."""

    nodes: dict[str, PoolNode]
    lock: asyncio.Lock
    slurm_queue: str | None
    slurm_drained: dict[str, str]
    slurm_held: list[str]
    slurm_epoch: int
    slurm_replacements: bool
    slurm_requested: int | None

    def _schedule_changed(self) -> None:
        raise NotImplementedError

    def state(self) -> PoolState:
        raise NotImplementedError

    def _standbys(self) -> list[PoolNode]:
        raise NotImplementedError

    def _standby_target(self) -> int:
        raise NotImplementedError

    def _init_slurm(self, state: PoolState | None) -> None:
        s = state or PoolState()
        self.slurm_queue = s.slurm_queue
        self.slurm_drained = dict(s.slurm_drained)
        self.slurm_held = list(s.slurm_held)
        self.slurm_epoch = s.slurm_epoch
        self.slurm_replacements = s.slurm_replacements
        self.slurm_requested = s.slurm_requested

    def _slurm_fields(self) -> dict[str, Any]:
        """The Slurm side of the pool's state, carried across continue-as-new."""
        return {
            "slurm_queue": self.slurm_queue,
            "slurm_drained": self.slurm_drained,
            "slurm_held": self.slurm_held,
            "slurm_epoch": self.slurm_epoch,
            "slurm_replacements": self.slurm_replacements,
            "slurm_requested": self.slurm_requested,
        }

    def _slurm_due(self) -> bool:
        return bool(self._slurm_changes()) or self._replacement_needed()

    def _live(self) -> int:
        return sum(n.state != "lost" for n in self.nodes.values())

    def _replacement_needed(self) -> bool:
        """Jobs run, with fewer standbys than the target, and no replacement is on its way (one
        is until a machine joins after the request)."""
        if self.slurm_queue is None or not self.slurm_replacements:
            return False
        if not any(n.state == "active" for n in self.nodes.values()):
            return False  # no job to keep alive: an allocation that is still starting is not short
        if self.slurm_requested is not None and self._live() <= self.slurm_requested:
            return False
        return len(self._standbys()) < self._standby_target()

    def _slurm_changes(self) -> list[SlurmNodeInput]:
        """Drains and resumes Slurm needs so that exactly the quarantined (and operator-held)
        machines are drained; lost machines stay as they are."""
        if self.slurm_queue is None:
            return []
        changes = (
            slurm_change(n, name in self.slurm_held, name in self.slurm_drained)
            for name, n in sorted(self.nodes.items(), key=lambda kv: _order(kv[0]))
        )
        return [c for c in changes if c is not None]

    async def _slurm_sync(self) -> None:
        changes = self._slurm_changes()
        queue = self.slurm_queue
        assert queue is not None
        if self._replacement_needed():
            # Asked once; the next request waits for a machine to join (or not: then an operator).
            self.slurm_requested = self._live()
            exclude = sorted(
                {*self.slurm_drained, *(k for k, n in self.nodes.items() if n.state == "quarantined")},
                key=_order,
            )
            await request_replacement(queue, exclude)
        results = await asyncio.gather(
            *(
                calls.slurm_node(c, task_queue=queue, summary=f"{c.node}: {'drain' if c.drain else 'resume'}")
                for c in changes
            ),
            return_exceptions=True,
        )
        failed = False
        async with self.lock:
            for c, r in zip(changes, results, strict=True):
                if isinstance(r, BaseException):
                    workflow.logger.warning("slurm %s of %s failed: %s", c.drain, c.node, r)
                    failed = True
                    continue
                if c.drain:
                    self.slurm_drained[c.node] = c.reason
                else:
                    self.slurm_drained.pop(c.node, None)
            self.slurm_epoch += 1
        if failed:
            # Tried again after a pause: a node Slurm does not know, or a worker that is away,
            # would otherwise grow the history with retries as fast as they fail.
            await workflow.sleep(SLURM_RETRY)

    async def attach_slurm(self, attach: SlurmAttach) -> PoolState:
        """The pool's Slurm worker (the one place with operator rights) serves ``attach.queue``."""
        async with self.lock:
            self.slurm_queue = attach.queue
            self.slurm_replacements = attach.replacements
            self.slurm_requested = None
            self.slurm_epoch += 1  # observations read before now may predate the attach
            return self.state()

    async def slurm_observed(self, obs: SlurmObservation) -> int:
        """An operator's drain or resume in Slurm reaches the pool: a machine drained there
        leaves service (quarantined once no job holds it) until resumed; one resumed there
        returns to standby. Observations older than the pool's latest drain or resume are
        dropped: they may predate it."""
        async with self.lock:
            if obs.epoch != self.slurm_epoch or self.slurm_queue is None:
                return 0
            now = workflow.now()
            changed = 0
            for name, reason in obs.nodes.items():
                n = self.nodes.get(name)
                if n is None:
                    continue
                if reason is not None and name not in self.slurm_drained:
                    self.slurm_drained[name] = reason
                    if name not in self.slurm_held:
                        self.slurm_held.append(name)
                    if n.job is None and n.state != "lost":
                        self.nodes[name] = n.model_copy(
                            update={
                                "state": "quarantined",
                                "reason": f"drained in Slurm: {reason}"[:500],
                                "since": now,
                            }
                        )
                    changed += 1
                elif reason is None and name in self.slurm_drained:
                    del self.slurm_drained[name]
                    if name in self.slurm_held:
                        self.slurm_held.remove(name)
                    if n.state == "quarantined":
                        self.nodes[name] = n.model_copy(
                            update={"state": "standby", "reason": "resumed in Slurm", "since": now}
                        )
                    changed += 1
            if changed:
                self.slurm_epoch += 1
                self._schedule_changed()
            return changed
