"""Diagnosis: the checks a decision asks for, run on the job's machines, and the decision their
result leads to (``trainguard.domain.policy.outcome_after_*``): stop-time checks (self-test,
intra-machine collective, pairwise rounds), stack aggregation, the alignment test and
dual-phase replay."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError

from trainguard.contract import calls
from workflows.job import fanout, patches
from workflows.job.attempt import latest_checkpoint
from workflows.job.outcome import AttemptOutcome, stop_request

with workflow.unsafe.imports_passed_through():
    from trainguard.domain import checkpoints
    from trainguard.domain.analysis import pairing
    from trainguard.domain.analysis.replay import replay_grid
    from trainguard.domain.code_versions import spec_for
    from trainguard.domain.job_state import JobInput, JobState
    from trainguard.domain.messages import (
        CHECK_PEER_GRACE_MAX_S,
        CHECK_START_BOUND_S,
        CheckpointRef,
        CheckResult,
        DiagnosticInput,
        Endpoint,
        PairTestInput,
        PortInput,
        RunRanksInput,
        RunRanksResult,
    )
    from trainguard.domain.policy import Decision, outcome_after_checks, outcome_after_replay
    from trainguard.domain.recovery import alignment_outcome, check_targets, stacks_outcome
    from trainguard.domain.topology import ranks_on

# A pair round runs at most this many pairs at once (patches.PAIR_WAVES): a pair keeps up to two
# activities pending (its rendezvous port, then both sides' checks), so at most 400, under the
# 500 Temporal advises for one workflow; a round of a job of up to 400 machines runs in one wave.
PAIRS_AT_ONCE = 200
# Decisions whose diagnosis runs checks on the machines (minutes at scale): a stop cuts them
# short. Not a replay (its dry-run ranks would be left to the agents' orphan timer; it is not run
# on a job of groups, whose checks take long).
CHECKS = ("stop-time-checks", "alignment-test")


async def rendezvous_port(
    task_queue: str,
    job_id: str,
    attempt: int,
    limit: timedelta = calls.SHORT,
    summary: str | None = None,
    pickup: timedelta = calls.PICKUP,
) -> Endpoint:
    """A free port on a machine for a diagnostic process group's rendezvous (no retry: a
    machine that does not take the call within ``pickup``, or answer within ``limit``, fails
    the check)."""
    return await calls.pick_master_port(
        PortInput(job_id=job_id, attempt=attempt),
        task_queue=task_queue,
        start_to_close=limit,
        schedule_to_start=pickup,
        summary=summary,
    )


class Diagnosis:
    def __init__(self, inp: JobInput, s: JobState) -> None:
        self.inp = inp
        self.s = s

    async def run(self, decision: Decision, outcome: AttemptOutcome, attempt: int) -> Decision | None:
        """Run the diagnosis a decision asks for; returns the decision its result leads to."""
        primary = outcome.primary
        assert primary is not None
        req = DiagnosticInput(
            job_id=self.s.spec.name, attempt=attempt, local_world=self.s.spec.ranks_per_node
        )
        if decision.action == "stop-time-checks":
            return await self._stop_time_checks(decision, req)
        if decision.action == "replay":
            return await self._replay(attempt)
        if decision.action == "stack-aggregation":
            # Stacks were taken while the hung ranks still stood: the attempt's outcome names them.
            return stacks_outcome(outcome.evict, primary.kind, primary.node, primary.evidence[-300:])
        if decision.action == "alignment-test":
            results = await fanout.on_machines(calls.alignment_test, req, self.s.nodes)
            reference = next((r.reference for r in results if r.reference), None)
            return alignment_outcome({r.node: r.digest for r in results}, reference)
        return None

    async def _stop_time_checks(self, decision: Decision, req: DiagnosticInput) -> Decision:
        """Cheapest first, stopping at the first check that names a machine: the compute
        self-test, the intra-machine collective (both on the suspects), then pairwise
        inter-machine rounds over the job's machines."""
        nodes = self.s.nodes
        targets = check_targets(decision)
        failed, details = await self._alone(req, targets)
        stragglers: list[str] = []
        links: list[tuple[str, str]] = []
        if not failed and len(nodes) > 1:
            slow_factor = self.s.spec.detection.slow_factor
            names = [n.name for n in nodes]
            round1 = await self._pair_round(pairing.first_round(names), req)
            round2 = await self._pair_round(pairing.second_round(names, round1, slow_factor), req)
            found = pairing.verdict(round1, round2, slow_factor)
            failed, stragglers = found.faulty, found.stragglers
            # Histories from before a failed link was acted on replay without it (a reattempt).
            if found.links and workflow.patched(patches.LINK_CHECKS):
                links = found.links
            details.append(found.evidence)
            # A link is named only between machines that pass alone: an end the suspects' checks
            # left out (a partner in the pair round) is tested first; failing, it is the culprit.
            untested = [m for pair in links for m in pair if targets is not None and m not in targets]
            if untested:
                alone_failed, alone = await self._alone(req, list(dict.fromkeys(untested)))
                details.extend(alone)
                if alone_failed:
                    failed, links = alone_failed, []
        return outcome_after_checks(failed, stragglers, evidence=" | ".join(details), links=links)

    async def _alone(self, req: DiagnosticInput, only: list[str] | None) -> tuple[list[str], list[str]]:
        """The checks a machine passes or fails by itself: the compute self-test, then the
        intra-machine collective (where it has more than one rank). Failed machines, details."""
        nodes = self.s.nodes
        results = await fanout.on_machines(calls.self_test, req, nodes, only=only)
        failed = [r.node for r in results if not r.passed]
        details = ["self-test: " + "; ".join(f"{r.node}: {r.evidence}" for r in results)]
        if not failed and req.local_world > 1:
            results = await fanout.on_machines(calls.collective_test, req, nodes, only=only)
            failed = [r.node for r in results if not r.passed]
            details.append(
                "intra-machine collective: " + "; ".join(f"{r.node}: {r.evidence}" for r in results)
            )
        return failed, details

    async def _pair_round(
        self, pairs: list[tuple[str, str]], req: DiagnosticInput
    ) -> list[pairing.PairResult]:
        """Every pair at once: the first machine hosts the rendezvous, both run ``pair_test``."""
        queues = {n.name: n.task_queue for n in self.s.nodes}
        limit = timedelta(seconds=req.timeout_s + 45)
        # A side's check process may take CHECK_START_BOUND_S to get ready and then wait up to
        # CHECK_PEER_GRACE_MAX_S for its partner to, before its own budget counts.
        check_limit = limit + timedelta(seconds=CHECK_START_BOUND_S + CHECK_PEER_GRACE_MAX_S)
        # Both sides of every pair of a wave are asked at once: a side the server hands over
        # late must not fail its pair.
        pickup = calls.pickup_within(2 * min(len(pairs), PAIRS_AT_ONCE))

        async def pair_test(rank: int, node: str, master: Endpoint) -> CheckResult:
            return await calls.pair_test(
                PairTestInput(job_id=req.job_id, attempt=req.attempt, rank=rank, master=master),
                task_queue=queues[node],
                start_to_close=check_limit,
                schedule_to_start=pickup,
                summary=f"{node}: pairwise check",
            )

        async def one(a: str, b: str) -> pairing.PairResult:
            try:
                master = await rendezvous_port(
                    queues[a], req.job_id, req.attempt, limit, f"{a}: pairwise check", pickup
                )
            except ActivityError as err:
                return pairing.PairResult(
                    machines=(a, b), ok=False, elapsed_s=0.0, evidence=f"{a}: {err.cause or err}"
                )
            sides = await asyncio.gather(
                *(pair_test(i, n, master) for i, n in enumerate((a, b))), return_exceptions=True
            )
            ok = all(isinstance(x, CheckResult) and x.passed for x in sides)
            elapsed = max((x.elapsed_s or 0.0 for x in sides if isinstance(x, CheckResult)), default=0.0)
            why = "; ".join(
                f"{n}: {x.evidence if isinstance(x, CheckResult) else x}"
                for n, x in zip((a, b), sides, strict=True)
            )
            return pairing.PairResult(machines=(a, b), ok=ok, elapsed_s=elapsed, evidence=why[:500])

        if len(pairs) > PAIRS_AT_ONCE and workflow.patched(patches.PAIR_WAVES):
            gate = asyncio.Semaphore(PAIRS_AT_ONCE)

            async def in_turn(a: str, b: str) -> pairing.PairResult:
                async with gate:
                    return await one(a, b)

            return list(await asyncio.gather(*(in_turn(a, b) for a, b in pairs)))
        return list(await asyncio.gather(*(one(a, b) for a, b in pairs)))

    async def _replay(self, attempt: int) -> Decision:
        """Dual-phase replay: a few steps of the job from its last checkpoint on every row of
        the machine grid, then every column (TP and PP kept, DP shrunk to the group); the
        failing row and column cross at the faulty machine."""
        spec = self.s.spec
        per_replica, rpn = spec.topology.tp * spec.topology.pp, spec.ranks_per_node
        if len(self.s.nodes) > self.inp.group_size:
            # Every machine at once from here, and a checkpoint by parts lists no shard to restore.
            return Decision(
                action="reattempt",
                rung="replay-clean",
                evidence=f"replay: not run on a job of more than {self.inp.group_size} machines",
            )
        if per_replica % rpn and rpn % per_replica:
            return Decision(
                action="reattempt",
                rung="replay-clean",
                evidence=f"replay: a replica of {per_replica} ranks does not fill machines of {rpn} ranks",
            )
        plan = replay_grid([n.name for n in self.s.nodes], max(1, per_replica // rpn))
        resume = await latest_checkpoint(self.s)
        failed: list[set[int]] = []
        notes: list[str] = []
        for phase, groups in ((1, plan.horizontal), (2, plan.vertical)):
            oks = await asyncio.gather(
                *(self._replay_group(g, resume, attempt * 100 + phase) for g in groups)
            )
            failed.append({i for i, (ok, _) in enumerate(oks) if not ok})
            kind = "row" if phase == 1 else "column"
            notes += [
                f"{kind} {i} [{', '.join(g)}]: {why}"
                for i, (g, (_, why)) in enumerate(zip(groups, oks, strict=True))
            ]
        decision = outcome_after_replay(plan, failed[0], failed[1])
        return decision.model_copy(update={"evidence": f"{decision.evidence} ({'; '.join(notes)})"[:2000]})

    async def _replay_group(
        self, machines: list[str], resume: CheckpointRef | None, tag: int
    ) -> tuple[bool, str]:
        """Replay on ``machines`` alone: (every rank finished cleanly, what happened)."""
        spec = self.s.spec
        rpn = spec.ranks_per_node
        index = {n.name: i for i, n in enumerate(self.s.nodes)}
        nodes = [self.s.nodes[index[m]] for m in machines]
        start = resume.step if resume else 0
        group_spec = spec_for(spec, self.s.code.release()).model_copy(
            update={
                "nodes": len(nodes),
                "topology": spec.topology.model_copy(
                    update={"dp": len(nodes) * rpn // (spec.topology.tp * spec.topology.pp)}
                ),
                "target_steps": min(start + spec.detection.replay_steps, spec.target_steps or 1_000_000_000),
                "checkpoint": spec.checkpoint.model_copy(update={"every_steps": 1_000_000}),
            }
        )
        job_id = f"{spec.name}.replay"
        try:
            master = await rendezvous_port(nodes[0].task_queue, job_id, tag)
        except ActivityError as err:
            return False, f"{nodes[0].name} unreachable: {err.cause or err}"
        runs = [
            calls.run_ranks(
                RunRanksInput(
                    job_id=job_id,
                    workflow_id=workflow.info().workflow_id,
                    chain=workflow.info().first_execution_run_id,
                    attempt=tag,
                    node=node,
                    node_index=i,
                    ranks=ranks_on(i, rpn),
                    spec=group_spec,
                    master=master,
                    ckpt_prefix=checkpoints.job_prefix(spec.checkpoint.s3_prefix, spec.name),
                    resume=resume,
                    restore_from={i * rpn + k: index[node.name] * rpn + k for k in range(rpn)},
                    dry_run=True,
                ),
                task_queue=node.task_queue,
                schedule_to_start=timedelta(seconds=10),
                start_to_close=timedelta(minutes=5),
                heartbeat=timedelta(seconds=self.inp.heartbeat_timeout_s),
                summary=f"{node.name}: replay {', '.join(machines)}",
            )
            for i, node in enumerate(nodes)
        ]
        results: list[RunRanksResult | BaseException] = await asyncio.gather(*runs, return_exceptions=True)
        # Ranks kept alive after a hang (for their stacks) are not needed here.
        await fanout.on_machines(
            calls.stop_ranks, stop_request(self.s, tag, job_id), self.s.nodes, only=machines
        )
        bad = []
        for node, r in zip(nodes, results, strict=True):
            if isinstance(r, BaseException):
                bad.append(f"{node.name}: {getattr(r, 'cause', None) or r}")
            elif not r.ok:
                what = r.incident.kind if r.incident else (r.message or "failed")
                bad.append(f"{node.name}: {what}")
        steps = f"steps {start + 1}-{group_spec.target_steps}"
        return (not bad, "; ".join(bad)[:300] if bad else f"{steps} clean")
