"""A machine whose self-test did not run is tested again; only repeated misses quarantine it.

The pool workflow on Temporal's time-skipping test server: one machine's agent fails its
first self-test activity (busy), another's fails every one (as an agent that never picks
them up does, after its 30 s schedule-to-start timeout: the same error path, in less time).
"""

from __future__ import annotations

from temporalio import activity
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from infra.stack import find_binary
from trainguard.contract.calls import self_test
from trainguard.domain.messages import CONTROLLER_QUEUE, CheckResult, DiagnosticInput, NodeInfo, PoolState
from trainguard.services import pool_client
from trainguard.services.temporal import wire_data_converter
from workflows.node_pool import POOL_WORKFLOWS
from workflows.pool_machine import SELF_TEST_MISSES

SELF_TEST = self_test.name


async def test_a_missed_self_test_is_retried_and_only_repeated_misses_quarantine() -> None:
    calls = 0

    @activity.defn(name=SELF_TEST)
    async def busy_once(req: DiagnosticInput) -> CheckResult:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ApplicationError("agent busy", non_retryable=True)
        return CheckResult(node="busy", passed=True, evidence="all checks passed")

    @activity.defn(name=SELF_TEST)
    async def never(req: DiagnosticInput) -> CheckResult:
        raise ApplicationError("agent away", non_retryable=True)

    env = await WorkflowEnvironment.start_time_skipping(
        data_converter=wire_data_converter,
        test_server_existing_path=find_binary("temporal-test-server"),
    )
    async with (
        env,
        Worker(env.client, task_queue=CONTROLLER_QUEUE, workflows=POOL_WORKFLOWS),
        Worker(env.client, task_queue="agent-busy", activities=[busy_once]),
        Worker(env.client, task_queue="agent-gone", activities=[never]),
    ):
        await pool_client.register(env.client, NodeInfo(name="busy", task_queue="agent-busy"))
        await pool_client.register(env.client, NodeInfo(name="gone", task_queue="agent-gone"))
        seen: list[PoolState] = []
        for _ in range(120):
            seen.append(await pool_client.state(env.client))
            nodes = seen[-1].nodes
            if nodes["busy"].state == "standby" and nodes["gone"].state == "quarantined":
                break
            await env.sleep(5)  # skipped time: the workflow's timers fire, nothing waits
        busy, gone = seen[-1].nodes["busy"], seen[-1].nodes["gone"]
        # The busy machine missed once, stayed a suspect, passed on the second try.
        assert busy.state == "standby", busy
        assert calls == 2
        assert any(s.nodes["busy"].missed_tests == 1 and s.nodes["busy"].state == "suspect" for s in seen)
        assert busy.missed_tests == 0 and busy.retest_at is None
        # The machine whose self-test never ran was quarantined after the last of its misses, not the first.
        assert gone.state == "quarantined", gone
        assert gone.reason is not None and "did not run" in gone.reason
        missed = {s.nodes["gone"].missed_tests for s in seen if s.nodes["gone"].state == "suspect"}
        assert missed >= set(range(1, SELF_TEST_MISSES)), missed
