"""The launcher every rank starts through: protection for a script that imports nothing of trainguard.

    python [-u] /path/to/trainguard/runtime/launch.py SCRIPT [ARGS...]
    python [-u] /path/to/trainguard/runtime/launch.py -m MODULE [ARGS...]

runs the script as ``python SCRIPT ARGS`` would, after installing, when torch is there:

- a global optimizer step hook: a ``step`` report on the agent's pipe (``TG_REPORT_FD``), at most
  every ``REPORT_EVERY_S``, with the step and the mean step time since the last report: progress,
  hang detection in seconds, fail-slow comparison;
- a non-finite gradient check at each optimizer step: a flag kept on the gradients' device (no
  synchronisation per step), read at the reporting cadence; a step a GradScaler skipped never
  reaches the optimizer, so it is never flagged; DTensor gradients are checked by their local shard;
- the uncaught-exception report (``error``), before the interpreter unwinds;
- the drill faults of ``trainguard inject`` (``TG_FAULT_FILE``), acting at the optimizer step;
- a liveness look every ``LIVE_EVERY_S``: when no optimizer step came since the last look but the
  main thread's Python stack moved (frames and their instruction offsets differ), the rank works
  (evaluation, a save, a script with no optimizer) and says so (``alive``). With a process group,
  each rank adds its movement to a counter in the group's store, and a rank reports ``alive``
  whenever the counter grew: ranks waiting at a barrier while rank 0 evaluates are not hung. A
  hung job (everyone blocked in one C call: a collective, a kernel, a lock) moves nowhere.

Self-contained: this file imports only the standard library, torch and its siblings
``protocol.py``, ``reporter.py`` and ``faults.py`` (loaded by path when trainguard is not
installed), so the agent can run it with any interpreter: the user's own venv or image. It reports
through ``trainguard.runtime.reporter``, as the runtime does: the same records, written alike.

Step counting: a step is one ``step()`` of the first optimizer that steps (a second optimizer
stepping in the same training step does not count twice). The count starts from the optimizer's
own step counter where it keeps one (Adam and most others: ``state[p]["step"]``, restored with
the script's checkpoint), so a resumed script continues its numbering; otherwise from 1 in each
attempt, which starts at step 0 after the incident that ended the previous one. The counter is
read again at each report, so a state loaded after a first step (DCP's ``get_state_dict`` steps
the optimizer once to make its state) moves the count forward. Either way the steps reported in
an attempt only grow.

A script that calls ``trainguard.runtime.init()`` gets the runtime's reports instead: the runtime
calls :func:`stand_down` and this launcher sends nothing more (its exception report included).
"""

from __future__ import annotations

import atexit
import functools
import importlib
import importlib.util
import os
import runpy
import sys
import threading
import time
from types import ModuleType
from typing import Any

# Reports are sent at most this often (and at exit): a pipe write per step would cost more than
# the step of a small model; the agent's hang detection works in seconds.
REPORT_EVERY_S = 0.5
# How often the liveness thread looks at the main thread's stack (a few microseconds a look).
LIVE_EVERY_S = 1.0
# The job-wide counter of stack movements, in the process group's store (fresh in each attempt).
ALIVE_KEY = "trainguard/alive"
# The name other modules (the runtime) find this launcher under, however it was started.
MODULE_NAME = "_trainguard_launch"
FLAGS = ("-u", "-B", "-s", "-E")
HERE = os.path.dirname(os.path.abspath(__file__))


def _sibling(name: str) -> ModuleType:
    """``trainguard.runtime.<name>``, or, where trainguard is not installed (the script's own
    interpreter), the file beside this one, loaded by path as ``_trainguard_<name>``."""
    try:
        return importlib.import_module(f"trainguard.runtime.{name}")
    except ImportError:
        pass
    alias = f"_trainguard_{name}"
    if alias not in sys.modules:
        spec = importlib.util.spec_from_file_location(alias, os.path.join(HERE, f"{name}.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[alias] = module
        spec.loader.exec_module(module)
    return sys.modules[alias]


protocol = _sibling("protocol")  # first: the reporter imports it, by that name where loaded by path
reporter = _sibling("reporter")


class _Params:
    """An optimizer's parameters, shaped like a module for the drill faults."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def parameters(self) -> Any:
        for group in self.optimizer.param_groups:
            yield from group["params"]


def stack_signature(frame: Any) -> tuple[tuple[int, int], ...]:
    """Where a thread is: each frame's code and instruction offset, innermost first. A thread
    blocked in one C call keeps it; a thread running Python changes it."""
    sig = []
    while frame is not None and len(sig) < 64:
        sig.append((id(frame.f_code), frame.f_lasti))
        frame = frame.f_back
    return tuple(sig)


def _group_store() -> Any:
    """The default process group's store once the script made the group, else None."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    initialized = getattr(c10d, "is_initialized", None)
    if initialized is None or not initialized():
        return None
    return c10d._get_default_store()


class Launcher:
    def __init__(self, fd: int, rank: int) -> None:
        self.reporter = reporter.Reporter(fd, rank)
        self.rank = rank
        self.active = True
        self.counted: int | None = None  # id of the optimizer whose steps count
        self.step = 0
        self.reported_step = 0
        self.last_report_t = time.monotonic()
        self.nonfinite: Any = None  # a bool tensor on the gradients' device
        self.faults: Any = None
        self.fault_file: Any = None
        self.step_times: list[float] = []
        self.hooks: list[Any] = []

    # -- optimizer hooks ----------------------------------------------------------
    def install(self, torch: ModuleType) -> None:
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        self.torch = torch
        self.hooks = [
            register_optimizer_step_pre_hook(self.before_step),
            register_optimizer_step_post_hook(self.after_step),
        ]
        self._watch_group_end()
        self._load_faults()

    def _watch_group_end(self) -> None:
        """A script that destroys its default process group is done training: its last step and
        ``exiting`` go then, not at the interpreter's exit. What follows (freeing the script's
        objects, gloo's teardown, the interpreter's shutdown) took over 5 s on a loaded machine
        with no step to report, and was taken for a hang."""
        c10d = sys.modules.get("torch.distributed.distributed_c10d")
        original = getattr(c10d, "destroy_process_group", None)
        if original is None or getattr(original, "_trainguard", False):
            return
        dist = sys.modules["torch.distributed"]

        @functools.wraps(original)
        def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            group = args[0] if args else kwargs.get("group")
            if group is None and self.active:
                self.at_exit()
            return out

        destroy_process_group._trainguard = True  # type: ignore[attr-defined]
        for module in (c10d, dist):
            if getattr(module, "destroy_process_group", None) is original:
                module.destroy_process_group = destroy_process_group

    def _load_faults(self) -> None:
        path = os.environ.get("TG_FAULT_FILE")
        if not path:
            return
        faults = self.faults = _sibling("faults")  # it imports torch: only where drills stand
        self.fault_file = faults.FaultFile(path, self.rank)

    def _counts(self, optimizer: Any) -> bool:
        if self.counted is None:
            self.counted = id(optimizer)
        return self.counted == id(optimizer)

    def before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.active or not self._counts(optimizer):
            return
        if self.fault_file is not None:
            median = sorted(self.step_times)[len(self.step_times) // 2] if self.step_times else 0.1
            active = self.fault_file.active(self.step + 1)
            if active:
                self.faults.apply(active, self.step + 1, _Params(optimizer), median, self._fired)
        self._check_grads(optimizer)

    def _fired(self, fault: dict[str, Any]) -> None:
        self.fault_file.used.add(str(fault.get("id")))
        self.reporter.fault_fired(fault)

    def _check_grads(self, optimizer: Any) -> None:
        torch = self.torch
        grads = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if hasattr(g, "to_local"):  # a DTensor: this rank's shard
                    g = g.to_local()
                grads.append(g.detach())
        if not grads:
            return
        with torch.no_grad():
            by_device: dict[Any, list[Any]] = {}
            for g in grads:
                by_device.setdefault(g.device, []).append(g)
            for device, gs in by_device.items():
                # One fused kernel per device and dtype, queued: nothing waits for it here.
                total = torch.stack([n.float() for n in torch._foreach_norm(gs)]).sum()
                bad = ~torch.isfinite(total)
                if self.nonfinite is None or self.nonfinite.device != device:
                    self.nonfinite = bad
                else:
                    self.nonfinite |= bad

    def after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.active or not self._counts(optimizer):
            return
        if self.step == 0:
            self.step = self._optimizer_step(optimizer) or 1
        else:
            self.step += 1
        now = time.monotonic()
        if now - self.last_report_t >= REPORT_EVERY_S:
            # The optimizer's counter again, at the reporting cadence: a state loaded after its
            # first step (DCP's get_state_dict steps it once with zero gradients to make the
            # state) moves the numbering forward, never back.
            own = self._optimizer_step(optimizer)
            if own is not None and own > self.step:
                self.step = own
            self.report(now)

    def _optimizer_step(self, optimizer: Any) -> int | None:
        """The optimizer's own step counter (restored with its state)."""
        for state in optimizer.state.values():
            step = state.get("step") if isinstance(state, dict) else None
            if step is not None:
                try:
                    return int(step)
                except (TypeError, ValueError, RuntimeError):
                    return None
        return None

    def report(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        done = self.step - self.reported_step
        if done <= 0:
            return
        if self.nonfinite is not None:
            bad = bool(self.nonfinite.item())  # the one synchronisation, at the reporting cadence
            self.nonfinite = None
            if bad:
                self.reporter.non_finite(self.step)
        step_time = (now - self.last_report_t) / done if self.reported_step else None
        if step_time is not None:
            self.step_times = [*self.step_times[-19:], step_time]
        self.reporter.send(protocol.Step(t="step", step=self.step, step_time_s=step_time))
        self.reported_step = self.step
        self.last_report_t = now

    # -- liveness -----------------------------------------------------------------------
    def start_liveness(self) -> None:
        threading.Thread(target=self._liveness, name="tg-liveness", daemon=True).start()

    def _liveness(self) -> None:
        main = threading.main_thread().ident
        state: dict[str, Any] = {"sig": None, "count": None, "step": -1}
        while self.active and self.reporter.open:
            time.sleep(LIVE_EVERY_S)
            try:
                self._look(main, state)
            except Exception:  # e.g. torch.distributed half imported: the next look sees it whole
                continue

    def _look(self, main: int | None, state: dict[str, Any]) -> None:
        frame = sys._current_frames().get(main) if main is not None else None
        sig = stack_signature(frame) if frame is not None else None
        moved = sig is not None and state["sig"] is not None and sig != state["sig"]
        state["sig"] = sig
        alive = moved
        store = _group_store()
        if store is not None:
            count = int(store.add(ALIVE_KEY, 1 if moved else 0))
            alive = moved or (state["count"] is not None and count > state["count"])
            state["count"] = count
        stepped = self.step != state["step"]
        state["step"] = self.step
        # Not before the group exists or a step came: a rank moving through its imports and
        # then waiting for its peers' rendezvous is starting, not hung.
        if alive and not stepped and self.active and (store is not None or self.step > 0):
            self.reporter.send(protocol.Alive(t="alive"))

    def stand_down(self) -> None:
        """The script joined through trainguard.runtime: its reports are the runtime's, from the
        runtime's own reporter on the same pipe."""
        self.active = False
        self.reporter.hand_over()
        for h in self.hooks:
            h.remove()
        self.hooks = []

    def at_exit(self) -> None:
        if self.active:
            self.report()
            self.reporter.send(protocol.Exiting(t="exiting"))


_launcher: Launcher | None = None


def install() -> Launcher | None:
    """Install the hooks in this process (once); None without a report pipe."""
    global _launcher
    if _launcher is not None:
        return _launcher
    fd = os.environ.get("TG_REPORT_FD", "")
    if not fd.isdigit():
        return None
    launcher = Launcher(int(fd), int(os.environ.get("RANK", "0")))
    sys.modules.setdefault(MODULE_NAME, sys.modules[__name__])
    launcher.reporter.report_fatal_errors()
    launcher.start_liveness()
    try:
        import torch
        import torch.optim.optimizer as optimizer_module
    except ImportError:  # not a torch script: the exception report is all there is to install
        pass
    else:
        if hasattr(optimizer_module, "register_optimizer_step_post_hook"):  # torch >= 2.0
            launcher.install(torch)
    atexit.register(launcher.at_exit)
    _launcher = launcher
    return launcher


def stand_down() -> None:
    if _launcher is not None:
        _launcher.stand_down()


def run_target(argv: list[str]) -> None:
    """Run ``SCRIPT ARGS`` or ``-m MODULE ARGS`` as ``__main__``, as ``python`` would."""
    argv = list(argv)
    while argv and argv[0] in FLAGS:
        argv.pop(0)
    if not argv:
        raise SystemExit("usage: launch.py [-u] SCRIPT [ARGS...] | -m MODULE [ARGS...]")
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(argv[0])
        sys.argv = [argv[0], *argv[1:]]
        sys.path.insert(0, os.path.dirname(script))
        runpy.run_path(script, run_name="__main__")


def main() -> None:
    # This file's directory (trainguard/runtime) must not shadow the script's imports.
    if sys.path and os.path.abspath(sys.path[0] or ".") == HERE:
        sys.path.pop(0)
    install()
    run_target(sys.argv[1:])


if __name__ == "__main__":
    # Started as a file: make this module the one the runtime finds (not a second copy).
    sys.modules[MODULE_NAME] = sys.modules[__name__]
    main()
