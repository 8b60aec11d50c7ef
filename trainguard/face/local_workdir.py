"""The local stack's ranks write where `trainguard run` was typed, as torchrun's ranks would.

Started as root, the local stack runs ranks as its own unprivileged user (``rank_user`` in its
record, ``infra/stack.py``), who cannot write root's directories. ``open_workdir`` lets that user
alone enter the directories down to the workdir and write in it (POSIX ACL entries naming it).
The record is read as plain JSON: the CLI runs in the user's directory, whose own ``infra``
package must never be imported in trainguard's place.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from trainguard.agent.rank_user import RankUser, RankUserError, let_write


def open_workdir(state_dir: Path, workdir: Path) -> list[Path]:
    """The directories changed (none where ranks run as the submitter). Refused for a
    directory holding the stack's state (its credentials)."""
    try:
        config = json.loads((state_dir / "stack.json").read_text())["config"]
        name, own_state = config.get("rank_user"), Path(config["state_dir"])
    except (OSError, ValueError, KeyError, TypeError):
        return []  # no local stack's record: not this stack's concern
    if not name or os.geteuid() != 0:
        return []
    workdir = workdir.resolve()
    if own_state.resolve().is_relative_to(workdir):
        raise RankUserError(
            f"workdir {workdir}: holds the stack's state dir {own_state}; "
            f"the ranks (user {name}) may not write there: run from a project directory"
        )
    return let_write(RankUser.lookup(name), workdir)
