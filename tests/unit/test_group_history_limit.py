"""A group continues as new at its own history limits, not at the server's first suggestion:
each continue-as-new re-attaches every machine of the group (200 ``run_ranks``), and a default
server suggests it at 4,096 events or 4 MB. A history from before the patch keeps the old rule."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from workflows.job import group, patches
from workflows.job.group import GROUP_MAX_HISTORY, GROUP_MAX_HISTORY_BYTES, RanksGroupWorkflow


def full(monkeypatch: pytest.MonkeyPatch, events: int, size: int, suggested: bool, patched: bool) -> bool:
    info = SimpleNamespace(
        get_current_history_length=lambda: events,
        get_current_history_size=lambda: size,
        is_continue_as_new_suggested=lambda: suggested,
    )
    monkeypatch.setattr(group.workflow, "info", lambda: info)
    monkeypatch.setattr(
        group.workflow, "patched", lambda p: patched if p == patches.GROUP_OWN_HISTORY_LIMIT else True
    )
    return RanksGroupWorkflow._history_full(object.__new__(RanksGroupWorkflow))


def test_the_servers_suggestion_no_longer_restarts_a_group(monkeypatch: pytest.MonkeyPatch) -> None:
    # Where a default server first suggests it (measured: a group at 4,107 events).
    assert not full(monkeypatch, 4107, 4 << 20, suggested=True, patched=True)
    assert full(monkeypatch, GROUP_MAX_HISTORY + 1, 1 << 20, suggested=False, patched=True)
    assert full(monkeypatch, 5000, GROUP_MAX_HISTORY_BYTES + 1, suggested=False, patched=True)
    # Before the patch: at the suggestion, as the recorded histories did.
    assert full(monkeypatch, 4107, 4 << 20, suggested=True, patched=False)
    assert not full(monkeypatch, 5000, GROUP_MAX_HISTORY_BYTES + 1, suggested=False, patched=False)
