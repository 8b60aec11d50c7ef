"""A real Slurm cluster on this machine for the tests: one slurmctld and three slurmd
(nodes n1..n3, all on 127.0.0.1, each on its own port), authenticated by a munged of
its own. Debian's slurm-wlm and munge are installed with apt-get when missing (as
root); everything lives in one temp dir and every daemon is stopped by pid.

Every client call goes through :meth:`SlurmCluster.env` (SLURM_CONF), never the
machine's /etc/slurm.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Self

from infra.apt import apt_install
from infra.processes import spawn, start_ticks, stop_pid, wait_for
from trainguard.agent.ports import free_ports

NODES = ("n1", "n2", "n3")
PARTITION = "tg"
_EXECUTABLES = ("slurmctld", "slurmd", "srun", "sinfo", "squeue", "scancel", "munged")
_PACKAGES = ("slurm-wlm", "munge")
_INSTALL_TIMEOUT_S = 900.0
_READY_TIMEOUT_S = 60.0


class SlurmUnavailable(RuntimeError):
    """This machine cannot run the test cluster (the message says why)."""


def ensure_slurm() -> None:
    """slurm-wlm and munge installed; apt-get them (after one `apt-get update`) when missing."""
    missing = [exe for exe in _EXECUTABLES if _which(exe) is None]
    if not missing:
        return
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable(f"{', '.join(missing)} missing and no apt-get to install them")
    if os.geteuid() != 0:
        raise SlurmUnavailable(f"{', '.join(missing)} missing; installing them needs root (apt-get)")
    apt_install(_PACKAGES, _INSTALL_TIMEOUT_S)


def _which(exe: str) -> str | None:
    return shutil.which(exe) or shutil.which(exe, path="/usr/sbin:/sbin")


class SlurmCluster:
    """``with SlurmCluster(tmp) as cluster:`` the cluster is up, all nodes idle."""

    def __init__(self, root: Path, nodes: tuple[str, ...] = NODES) -> None:
        self.root = root
        self.nodes = nodes
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge" / "munge.socket"
        self._pids: list[tuple[str, int, int | None]] = []

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for a Slurm client (srun, sinfo, scontrol) talking to this cluster."""
        return {**(os.environ if base is None else base), "SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), capture_output=True, text=True, env=self.env(), timeout=timeout_s)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        if os.geteuid() != 0:
            raise SlurmUnavailable("slurmd must run as root (it starts tasks as the job's user)")
        ensure_slurm()
        try:
            self._start_munge()
            self._write_config()
            self._spawn("slurmctld", [_exe("slurmctld"), "-D", "-i", "-f", str(self.conf)])
            for node in self.nodes:
                self._spawn(f"slurmd-{node}", [_exe("slurmd"), "-D", "-N", node, "-f", str(self.conf)])
            self.wait_idle()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Every job cancelled (their step daemons end with them), then every daemon this
        cluster started, newest first, by pid."""
        if self._pids and self.conf.exists():
            self.run("scancel", f"--partition={PARTITION}")
            deadline = time.monotonic() + _READY_TIMEOUT_S
            while time.monotonic() < deadline and self.jobs():
                time.sleep(0.2)  # polling squeue: Slurm offers nothing to wait on
        while self._pids:
            _, pid, ticks = self._pids.pop()
            stop_pid(pid, grace_s=10.0, ticks=ticks)

    def jobs(self) -> list[str]:
        """Ids of this cluster's jobs that are not finished."""
        done = self.run("squeue", "--noheader", "--format=%i")
        return done.stdout.split() if done.returncode == 0 else []

    def node_states(self) -> dict[str, str]:
        """Node name -> Slurm state as sinfo reports it (idle, alloc, drain, down*, ...)."""
        done = self.run("sinfo", "--noheader", "--Node", "--format=%N %t")
        if done.returncode != 0:
            return {}
        return dict(line.split(None, 1) for line in done.stdout.splitlines() if line.strip())

    def wait_idle(self, timeout_s: float = _READY_TIMEOUT_S) -> None:
        log = self.root / "log" / "slurmctld.log"
        wait_for(
            lambda: all(self.node_states().get(n) == "idle" for n in self.nodes),
            timeout_s,
            f"slurm nodes {', '.join(self.nodes)} idle (sinfo: {self.node_states()})",
            log_path=log,
        )

    def _spawn(self, name: str, argv: list[str], env: Mapping[str, str] | None = None) -> int:
        (self.root / "log").mkdir(parents=True, exist_ok=True)
        pid = spawn(argv, self.root / "log" / f"{name}.out", env=self.env(env))
        self._pids.append((name, pid, start_ticks(pid)))
        return pid

    def _start_munge(self) -> None:
        """A munged with its own key and socket: nothing of the machine's munge is touched."""
        d = self.munge_socket.parent
        d.mkdir(parents=True, exist_ok=True)
        d.chmod(0o700)
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._spawn(
            "munged",
            [
                _exe("munged"),
                "--foreground",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--log-file={d / 'munged.log'}",
                f"--pid-file={d / 'munged.pid'}",
                f"--seed-file={d / 'munged.seed'}",
            ],
        )
        wait_for(self.munge_socket.exists, 15.0, "munged socket", log_path=d / "munged.log")

    def _write_config(self) -> None:
        ctld_port, *node_ports = free_ports(1 + len(self.nodes), avoid_grpc_twins=False)
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        r = self.root
        lines = [
            "ClusterName=tgtest",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}/%n",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd-%n.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "SchedulerType=sched/builtin",
            "SelectType=select/linear",
            # A node that comes back (or an operator's resume) serves again at once.
            "ReturnToService=2",
            "SlurmdTimeout=30",
            "InactiveLimit=0",
            "KillWait=30",  # the default: SIGTERM, then SIGKILL 30 s later
            "MinJobAge=60",
            "MailProg=/bin/true",
        ]
        lines += [
            f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} CPUs=1 State=UNKNOWN"
            for n, p in zip(self.nodes, node_ports, strict=True)
        ]
        lines.append(
            f"PartitionName={PARTITION} Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP"
        )
        self.conf.write_text("\n".join(lines) + "\n")
        # No cgroups: processes are tracked through /proc (proctrack/linuxproc).
        (r / "cgroup.conf").write_text("CgroupAutomount=no\nConstrainCores=no\nConstrainRAMSpace=no\n")


def _exe(name: str) -> str:
    found = _which(name)
    if found is None:
        raise SlurmUnavailable(f"{name} not found after installing slurm-wlm and munge")
    return found
