"""Debian packages that tests and stacks need, installed with apt-get when missing: CI runs as
root on a fresh machine that lacks them."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence


def apt_install(packages: Sequence[str], timeout_s: float = 900.0) -> None:
    """`apt-get update` once, then install ``packages`` without recommends; RuntimeError naming
    the command that failed, with the end of its stderr."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", *packages]):
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout_s, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()[-2000:]}")
