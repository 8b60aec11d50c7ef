"""Real-time training-side checks, as pure code the agent feeds with rank reports.

- ``classify_exit``: what a rank's exit code and stderr tail say (CUDA error,
  NCCL/gloo error, OOM, an exception in the user's own code with its location, a
  signal).
- ``TrainingMonitor``: NaN/Inf in loss or gradient norm, a loss or gradient-norm
  spike against the rolling median, no progress (hang) with a threshold adapted
  to the measured step time, and no first step within the startup timeout.
- ``incident_priority``: when several machines report at once, which report is
  the cause and which are consequences (a peer's gloo error follows a crash).

Times are plain floats (monotonic seconds) so the code is trivially testable.
"""

from __future__ import annotations

import math
import re
import signal as signal_mod
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from pydantic import BaseModel, ConfigDict

from trainguard.domain.analysis.alignment import majority_vote
from trainguard.domain.spec import DetectionSpec, Topology
from trainguard.domain.topology import group_of

# Kinds a machine itself is blamed for when reported with high confidence.
MACHINE_KINDS = frozenset(
    {
        "gpu-lost",
        "gpu-xid",
        "ecc",
        "row-remap",
        "disk-full",
        "nic-down",
        "nic-flap",
        "machine-lost",
        "kernel-fault",
    }
)
SPIKE_WARMUP = 10
SPIKE_WINDOW = 20


class ExitInfo(BaseModel):
    model_config = ConfigDict(frozen=True)

    error_class: str  # cuda | nccl | gloo | oom | rendezvous | python | signal | unknown
    summary: str
    user_code: bool = False
    code_location: str | None = None  # "module.py:123"
    exception: str | None = None  # "TypeError"


_TRACE_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)', re.M)
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Injected)):?\s?(.*)$", re.M)


_RENDEZVOUS_ERRORS = {"DistNetworkError", "DistStoreError"}
# torch.distributed's excepthook prints every line of a rank's traceback as "[rank3]: ...".
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?", re.M)


def _last_exception(tail: str) -> tuple[str | None, str]:
    found = _EXC_LINE.findall(tail)
    if not found:
        return None, ""
    name, msg = found[-1]
    return name.rsplit(".", 1)[-1], msg.strip()


def _user_frame(tail: str, code_dir: PurePath | None) -> str | None:
    """The innermost traceback frame in the job's own code (not libraries, not trainguard)."""
    for path, line, _func in reversed(_TRACE_FRAME.findall(tail)):
        if "site-packages" in path or "/trainguard/" in path or path.startswith("<"):
            continue
        p = PurePath(path)
        if code_dir is not None and p.is_absolute():
            try:
                p = p.relative_to(code_dir)
            except ValueError:
                if "/lib/python" in path:
                    continue
        return f"{p}:{line}"
    return None


def classify_exit(
    exit_code: int | None, signal: int | None, stderr_tail: str, code_dir: PurePath | None = None
) -> ExitInfo:
    stderr_tail = _RANK_PREFIX.sub("", stderr_tail)
    low = stderr_tail.lower()
    exc, msg = _last_exception(stderr_tail)
    if exc == "RendezvousError":
        # tg.init's bounded rendezvous: the group did not form (torch's message may name gloo).
        return ExitInfo(error_class="rendezvous", summary=msg[:300], exception=exc)
    if "out of memory" in low or "memoryerror" in low or "bad_alloc" in low:
        return ExitInfo(error_class="oom", summary=(msg or "out of memory")[:300], exception=exc)
    if "cuda error" in low or "cudaerror" in low or "illegal memory access" in low or "xid" in low:
        return ExitInfo(error_class="cuda", summary=(msg or "CUDA error")[:300], exception=exc)
    if "nccl" in low:
        return ExitInfo(error_class="nccl", summary=(msg or "NCCL error")[:300], exception=exc)
    if "gloo" in low or "connection closed by peer" in low or "connection reset by peer" in low:
        return ExitInfo(error_class="gloo", summary=(msg or "collective failed")[:300], exception=exc)
    if exc in _RENDEZVOUS_ERRORS or "address already in use" in low:
        # torch.distributed's own store or rendezvous failed (a port taken, a peer's store
        # gone): the launch failed, not the job's code that called init_process_group.
        return ExitInfo(error_class="rendezvous", summary=f"{exc}: {msg}"[:300], exception=exc)
    if exc is not None:
        where = _user_frame(stderr_tail, code_dir)
        return ExitInfo(
            error_class="python",
            summary=f"{exc}: {msg}"[:300],
            user_code=where is not None,
            code_location=where,
            exception=exc,
        )
    if signal is not None:
        try:
            name = signal_mod.Signals(signal).name
        except ValueError:
            name = str(signal)
        return ExitInfo(error_class="signal", summary=f"killed by {name}")
    return ExitInfo(error_class="unknown", summary=f"exit code {exit_code}")


# The job's process group did not form within the rendezvous bound (tg.init): a stall like a
# hang, seen from the ranks' own errors (who could not reach whose store).
RENDEZVOUS_KIND = "rendezvous"


def exit_kind(info: ExitInfo) -> str:
    """The incident kind a rank exit maps to."""
    if info.user_code:
        return "user-code"
    if info.exception == "RendezvousError":
        return RENDEZVOUS_KIND
    if info.error_class in ("nccl", "gloo"):
        return "comm"
    if info.error_class == "oom":
        return "oom"
    return "crash"


class Anomaly(BaseModel):
    model_config = ConfigDict(frozen=True)

    kind: str
    ranks: list[int]
    evidence: str
    # True when the anomaly started on this machine (not merely seen here after an all-reduce).
    origin: bool = False
    confidence: float = 0.5
    step: int | None = None


def _finite(x: Any) -> bool:
    return x is None or (isinstance(x, int | float) and math.isfinite(x))


class TrainingMonitor:
    """The checks one machine runs over its own ranks' reports during an attempt."""

    def __init__(self, spec: DetectionSpec, ranks: list[int], started_at: float) -> None:
        self.spec = spec
        self.ranks = ranks
        self.started_at = started_at
        self.last_step: dict[int, int] = {}
        self.last_step_at: dict[int, float] = {}
        self.step_times: deque[float] = deque(maxlen=50)
        self.history: dict[tuple[int, str], deque[float]] = {}
        self.local_spikes: dict[int, dict[int, float]] = {}  # step -> rank -> ratio
        self.finished: set[int] = set()

    def _ratio(self, rank: int, name: str, value: float | None, step: int) -> float | None:
        """``value`` over the rolling median of earlier values (None while warming up);
        a value that is a spike does not join the baseline."""
        if value is None:
            return None
        hist = self.history.setdefault((rank, name), deque(maxlen=SPIKE_WINDOW))
        ratio = None
        if len(hist) >= SPIKE_WARMUP and step > self.spec.spike_warmup_steps:
            med = statistics.median(hist)
            ratio = value / med if med > 0 else None
        if ratio is None or ratio < self.spec.spike_factor:
            hist.append(value)
        return ratio

    def _spike(self, rank: int, name: str, value: float | None, step: int) -> Anomaly | None:
        ratio = self._ratio(rank, name, value, step)
        if ratio is None or ratio < self.spec.spike_factor or value is None:
            return None
        med = value / ratio  # the median it was measured against (one median per value, not two)
        return Anomaly(
            kind="loss-spike",
            ranks=[rank],
            confidence=0.6,
            step=step,
            evidence=f"rank {rank} step {step}: {name} {value:.4g} is {ratio:.1f}x "
            f"the rolling median {med:.4g} (threshold {self.spec.spike_factor}x)",
        )

    def on_local(self, rank: int, rec: dict[str, Any]) -> Anomaly | None:
        """A rank's own gradients, sent before the all-reduce: the only moment the origin
        of a NaN or a spike is visible, and before any peer can see its effect."""
        step = int(rec["step"])
        if rec.get("local_nonfinite"):
            return Anomaly(
                kind="nan",
                ranks=[rank],
                origin=True,
                confidence=0.7,
                step=step,
                evidence=f"rank {rank} step {step}: its own gradients are NaN/Inf before the all-reduce",
            )
        ratio = self._ratio(rank, "local", rec.get("local_grad_norm"), step)
        if ratio is not None and ratio >= self.spec.spike_factor:
            self.local_spikes[step] = {**self.local_spikes.get(step, {}), rank: ratio}
        return None

    def on_step(self, rank: int, rec: dict[str, Any], now: float) -> Anomaly | None:
        step = int(rec["step"])
        if rec.get("local_grad_norm") is not None:  # this step's own-gradient norm, first
            self.on_local(rank, rec)
        self.last_step[rank] = step
        self.last_step_at[rank] = now
        if rec.get("step_time_s") is not None:
            self.step_times.append(float(rec["step_time_s"]))
        for name in ("loss", "grad_norm"):
            if not _finite(rec.get(name)):
                return Anomaly(
                    kind="nan",
                    ranks=[rank],
                    origin=False,
                    confidence=0.5,
                    step=step,
                    evidence=f"rank {rank} step {step}: {name} is {rec.get(name)}",
                )
        # The job-wide loss and gradient norm decide; a local rank whose own gradient
        # norm spiked at this step (see on_local) says the spike started on this machine.
        for name in ("loss", "grad_norm"):
            found = self._spike(rank, name.replace("_", " "), rec.get(name), step)
            if found is not None:
                local = self.local_spikes.get(step, {})
                if not local:
                    return found
                where = ", ".join(f"rank {r} {x:.1f}x" for r, x in sorted(local.items()))
                return found.model_copy(
                    update={
                        "origin": True,
                        "ranks": sorted(local),
                        "evidence": f"{found.evidence}; own gradient norm spiked on {where}",
                    }
                )
        for old in [s for s in self.local_spikes if s < step - 10]:
            del self.local_spikes[old]
        return None

    @property
    def median_step_s(self) -> float | None:
        return statistics.median(self.step_times) if self.step_times else None

    def hang_threshold_s(self) -> float:
        med = self.median_step_s
        return max(self.spec.hang_factor * med if med else 0.0, self.spec.hang_floor_s)

    def on_alive(self, rank: int, now: float, finished: bool = False, working: bool = False) -> None:
        """Other signs of life: a checkpoint written counts as progress, a finished rank
        is no longer expected to make any. ``working``: the rank runs the script (its stack
        moves) without optimizer steps: from then on its silences are timed as hangs, not
        against the startup timeout."""
        if finished:
            self.finished.add(rank)
        # The finish is a sign of life too: a finished rank's exit is timed from its last one.
        if rank in self.last_step_at or working or finished:
            self.last_step_at[rank] = now

    def stuck_in_exit(self, now: float, running: Iterable[int], bound_s: float) -> list[int]:
        """Finished ranks whose processes are still ``running`` with no sign of life (a step,
        a moving stack) for ``bound_s``: stuck in their exit (a native teardown, the interpreter's
        shutdown), no longer training. A finished rank that still works (rank 0 uploading the
        final model) keeps sending signs of life and is left alone."""
        return [r for r in running if r in self.finished and now - self.last_step_at[r] > bound_s]

    def check(self, now: float) -> Anomaly | None:
        """Time-based checks: a rank with no first step in time, or no progress (hang)."""
        waiting = [r for r in self.ranks if r not in self.finished]
        starting = [r for r in waiting if r not in self.last_step_at]
        if starting:
            waited = now - self.started_at
            if waited > self.spec.startup_timeout_s:
                return Anomaly(
                    kind="hang",
                    ranks=starting,
                    confidence=0.4,
                    evidence=f"ranks {starting}: no first step {waited:.0f}s after start (startup timeout "
                    f"{self.spec.startup_timeout_s:.0f}s)",
                )
            return None
        if not waiting:
            return None
        oldest_rank = min(waiting, key=lambda r: self.last_step_at[r])
        since = now - self.last_step_at[oldest_rank]
        threshold = self.hang_threshold_s()
        if since > threshold:
            step = self.last_step.get(oldest_rank, 0)
            return Anomaly(
                kind="hang",
                ranks=list(waiting),
                confidence=0.4,
                step=step,
                evidence=f"rank {oldest_rank}: no progress for {since:.1f}s after step {step} "
                f"(threshold {threshold:.1f}s = max({self.spec.hang_factor:g} x median step "
                f"{(self.median_step_s or 0):.3f}s, floor {self.spec.hang_floor_s:g}s))",
            )
        return None


def incident_priority(kind: str, confidence: float, origin: bool) -> int:
    """Rank concurrent reports of one failure: the cause outranks its consequences."""
    if kind == "machine-lost":
        return 100
    if kind == "setup":
        return 95  # the job cannot start: what the others then see follows from it
    if kind in MACHINE_KINDS and confidence >= 0.9:
        return 90
    if kind == "comm":
        return 20  # a collective failed because some peer went away first
    if origin or kind in ("crash", "user-code", "oom", "sdc", "slow"):
        return 70
    if kind in MACHINE_KINDS:
        return 60
    return 50


def replica_mismatch(
    hashes: Mapping[int, str], topology: Topology, placement: Mapping[int, str]
) -> tuple[list[str], list[str]]:
    """Machines whose data-parallel replicas hold parameters that differ from their group's
    majority, with the evidence; every machine of a group without a unique majority (two
    replicas that differ: there is no telling which one is right)."""
    bad: list[str] = []
    evidence: list[str] = []
    for first in range(topology.world_size):
        group = group_of(first, "dp", topology)
        if group[0] != first or len({hashes[g] for g in group}) == 1:
            continue
        vote = majority_vote({g: hashes[g] for g in group}, need="plurality", no_winner="everyone")
        bad += [placement[g] for g in vote.odd if placement[g] not in bad]
        evidence.append(f"dp group {group}: " + ", ".join(f"rank {g} {hashes[g][7:19]}" for g in group))
    return bad, evidence


@dataclass(frozen=True)
class SlowStreak:
    """Fail-slow detection after one round: the machine slowest for ``rounds`` rounds in a row."""

    suspect: str | None
    rounds: int
    # Set once the streak is long enough: the machine is failing slow.
    evidence: str | None = None


def fail_slow_round(
    compute_s: Mapping[str, float], streak: SlowStreak, slow_factor: float, slow_rounds: int
) -> SlowStreak:
    """One round of fail-slow detection over each machine's compute time per step: a machine
    ``slow_factor`` times slower than the fastest, round after round, is failing slow."""
    fastest = min(compute_s.values())
    node, slowest = max(compute_s.items(), key=lambda kv: kv[1])
    if fastest <= 0 or slowest < slow_factor * fastest:
        return SlowStreak(suspect=None, rounds=0)
    rounds = streak.rounds + 1 if node == streak.suspect else 1
    if rounds < slow_rounds:
        return SlowStreak(suspect=node, rounds=rounds)
    evidence = (
        f"{node} computes {slowest:.3f}s per step vs {fastest:.3f}s on the fastest machine "
        f"({slowest / fastest:.1f}x, threshold {slow_factor:g}x) for {rounds} rounds"
    )
    return SlowStreak(suspect=node, rounds=rounds, evidence=evidence)
