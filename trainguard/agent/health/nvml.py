"""GPU health from NVML (nvidia-ml-py's ``pynvml``), read on the host at second-level intervals.

The probe never loads the GPU: it only reads driver counters and drains the driver's event queue,
so it can run every couple of seconds next to training. On a machine without the NVIDIA driver
it says so once (``provider-unavailable``) and then stays silent, so CPU-only machines and CI
behave like a GPU machine with nothing to report.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from datetime import datetime
from types import ModuleType
from typing import Any, NamedTuple

from trainguard.agent.health.events import EventKind, HealthEvent, Probe, Severity

log = logging.getLogger(__name__)


class XidClass(NamedTuple):
    severity: Severity
    confidence: float  # how sure an Xid of this number means the machine (not the job) is at fault
    meaning: str


# One table for every provider that sees an Xid (NVML events here, kernel log in host.py), so the
# same Xid gets the same verdict whichever path reports it first. Numbers from NVIDIA's Xid catalog.
XID_CLASSES: dict[int, XidClass] = {
    # Application-triggered: the usual cause is the job's own code, so a low confidence lets a
    # reattempt on the same machine happen before anyone suspects the hardware.
    13: XidClass("warning", 0.3, "graphics engine exception (illegal instruction or address in a kernel)"),
    31: XidClass("warning", 0.3, "GPU memory page fault (MMU fault, usually an illegal access by user code)"),
    43: XidClass("warning", 0.3, "GPU stopped processing (the application hit a fault; GPU still usable)"),
    45: XidClass("warning", 0.3, "preemptive cleanup of a channel after earlier errors or a killed process"),
    # Hardware or driver state that needs the machine out of the job (reset, RMA, reboot).
    48: XidClass("critical", 1.0, "double-bit (uncorrectable) ECC error"),
    63: XidClass("critical", 1.0, "ECC page retirement / row remapping event recorded (reset required)"),
    64: XidClass("critical", 1.0, "ECC page retirement / row remapping recording failure"),
    74: XidClass("critical", 1.0, "NVLink error"),
    79: XidClass("critical", 1.0, "GPU has fallen off the bus (device lost until reset or reboot)"),
    92: XidClass("critical", 1.0, "high single-bit ECC error rate"),
    94: XidClass("critical", 1.0, "contained ECC error (affected context killed; row remap pending)"),
    95: XidClass("critical", 1.0, "uncontained ECC error (all contexts on the GPU affected; reset required)"),
    119: XidClass("critical", 1.0, "GSP RPC timeout (GPU firmware stopped answering the driver)"),
    120: XidClass("critical", 1.0, "GSP error (GPU firmware fault)"),
    # Known but ambiguous: could be the driver, the firmware or the load; listed so the table says so.
    61: XidClass("warning", 0.6, "internal micro-controller breakpoint / warning"),
    62: XidClass("warning", 0.6, "internal micro-controller halt"),
    69: XidClass("warning", 0.6, "graphics engine class error"),
    109: XidClass("warning", 0.6, "context switch timeout"),
}
# Any Xid not in the table: something is wrong, but not known to be the machine.
XID_DEFAULT = XidClass("warning", 0.6, "unclassified Xid")
# Xids after which the device is gone: also reported as gpu-lost.
XID_GPU_LOST: frozenset[int] = frozenset({79})


def classify_xid(xid: int) -> XidClass:
    """Severity, confidence and meaning of an Xid number."""
    return XID_CLASSES.get(xid, XID_DEFAULT)


def pci_key(address: str) -> str:
    """One spelling of a GPU's PCI address for NVML ("00000000:3B:00.0") and the kernel log
    ("0000:3b:00"): "dddd:bb:dd", so an Xid seen by both providers can be matched to one device."""
    parts = address.strip().lower().split(":")
    try:
        if len(parts) == 2:
            parts = ["0", *parts]
        domain, bus, device = parts[-3], parts[-2], parts[-1].split(".")[0]
        return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}"
    except (ValueError, IndexError):
        return address.strip().lower()


# Fallback values of pynvml constants (used only if an injected module lacks one).
_DEFAULTS: dict[str, int] = {
    "NVML_ERROR_NOT_SUPPORTED": 3,
    "NVML_ERROR_TIMEOUT": 10,
    "NVML_ERROR_FUNCTION_NOT_FOUND": 13,
    "NVML_ERROR_GPU_IS_LOST": 15,
    "NVML_ERROR_RESET_REQUIRED": 16,
    "NVML_ERROR_UNKNOWN": 999,
    "NVML_TEMPERATURE_GPU": 0,
    "NVML_VOLATILE_ECC": 0,
    "NVML_MEMORY_ERROR_TYPE_CORRECTED": 0,
    "NVML_MEMORY_ERROR_TYPE_UNCORRECTED": 1,
    "NVML_FEATURE_ENABLED": 1,
    "nvmlEventTypeSingleBitEccError": 0x1,
    "nvmlEventTypeDoubleBitEccError": 0x2,
    "nvmlEventTypeXidCriticalError": 0x8,
    "nvmlClocksEventReasonGpuIdle": 0x1,
    "nvmlClocksEventReasonHwSlowdown": 0x8,
    "nvmlClocksEventReasonSwThermalSlowdown": 0x20,
    "nvmlClocksEventReasonHwThermalSlowdown": 0x40,
}

# Throttle reasons that point at heat or a hardware slowdown signal (not power caps or idling).
_THERMAL_REASONS: tuple[tuple[str, str], ...] = (
    ("nvmlClocksEventReasonHwSlowdown", "hw_slowdown"),
    ("nvmlClocksEventReasonHwThermalSlowdown", "hw_thermal"),
    ("nvmlClocksEventReasonSwThermalSlowdown", "sw_thermal"),
)
_THERMAL_HYSTERESIS_C = 3  # a hot GPU counts as cooled only this far below the threshold

_SKIP = object()  # a query that gave no reading (unsupported or failed): keep the previous verdict


def count_gpus() -> int:
    """The GPUs NVML sees on this machine (0 without NVML or a driver): what the agent reports to
    the pool, for ``trainguard run --nproc-per-node gpu``."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no pynvml, no library, no driver: no GPU to count
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:
        return 0
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


class _DeviceLost(Exception):
    """A query on one device said the device is gone (GPU_IS_LOST, UNKNOWN, RESET_REQUIRED)."""

    def __init__(self, query: str, error: str) -> None:
        super().__init__(f"{query}: {error}")
        self.query = query
        self.error = error


def _text(value: Any) -> str:
    """pynvml returns str or bytes depending on version and function."""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)


def _refusal_key(index: int | None, query: str) -> str:
    return query if index is None else f"{query}[{index}]"


def _address(handle: Any) -> int | None:
    """The pointer value behind an NVML handle: handles from events are new ctypes objects."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except Exception:
        return None


class NvmlProbe(Probe):
    """GPU faults from NVML: lost devices, Xid events, uncorrected ECC, row remapping, heat, PCIe.

    ``nvml`` is the pynvml module or a stand-in with the same API (tests); None imports pynvml.
    ``expected_gpus`` None means "as many as were visible at start".
    """

    name = "nvml"
    source = "nvml"

    def __init__(
        self,
        node: str,
        expected_gpus: int | None = None,
        nvml: Any = None,
        *,
        temperature_threshold_c: int = 90,
        max_events_per_check: int = 256,
    ) -> None:
        self.node = node
        self.expected_gpus = expected_gpus
        self.temperature_threshold_c = temperature_threshold_c
        self.max_events_per_check = max_events_per_check
        self._lock = threading.Lock()
        self._nvml: Any = nvml
        self._ready = False
        self._closed = False
        self._unavailable: str | None = None  # why NVML cannot run here
        self._unavailable_said = False
        self._baseline_count: int | None = None
        self._last_count: int | None = None
        self._event_set: Any = None
        self._handles: dict[int, Any] = {}
        self._registered: dict[int, int] = {}  # device index -> event mask registered
        self._unsupported: set[tuple[int | None, str]] = set()
        # What NVML refused here, with its own words, the last error of each query
        # ("nvmlEventSetCreate", "nvmlDeviceGetRemappedRows[0]" for device 0): not supported,
        # no permission (virtualised GPUs)...; said in the inventory, never only logged.
        self.refused: dict[str, str] = {}
        self._ecc_last: dict[int, int] = {}
        self._sbe_events: dict[int, int] = {}  # corrected single-bit ECC events seen (no event emitted)
        self._reported: dict[tuple[str, int | None], object] = {}
        self._hot: set[int] = set()  # devices last seen above the temperature threshold
        self._pci: dict[int, str] = {}  # device index -> pci_key, added to that device's events
        self._init()

    # ----------------------------------------------------------------------------------- set-up

    def _const(self, name: str) -> int:
        return int(getattr(self._nvml, name, _DEFAULTS[name]))

    def _init(self) -> None:
        """nvmlInit once; any failure makes the provider unavailable for good (said once)."""
        if self._nvml is None:
            try:
                import pynvml

                self._nvml = pynvml
            except ImportError as exc:
                self._unavailable = f"pynvml not importable: {exc}"
                return
        try:
            self._nvml.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, or anything else
            self._unavailable = f"{type(exc).__name__}: {exc}"
            return
        self._ready = True
        count = self._call(None, "nvmlDeviceGetCount")
        if isinstance(count, int):
            self._baseline_count = self._last_count = count
        try:
            self._event_set = self._nvml.nvmlEventSetCreate()
        except Exception as exc:
            self.refused["nvmlEventSetCreate"] = f"{type(exc).__name__}: {exc}"
            log.warning("nvml: no event set, Xid events will not be seen: %s", exc)
        for index in range(self._baseline_count or 0):
            try:
                handle = self._device_call(index, "nvmlDeviceGetHandleByIndex", index)
                if handle is not _SKIP:
                    self._register_events(index, handle)
            except _DeviceLost:
                continue  # reported by the first check

    @property
    def available(self) -> bool:
        return self._ready and not self._closed

    @property
    def gpu_count(self) -> int:
        """GPUs NVML found at start (0 where it cannot run)."""
        return self._baseline_count or 0

    def _call(self, index: int | None, query: str, *args: Any) -> Any:
        """One guarded NVML call: the value, or _SKIP. Never raises (lost devices included)."""
        try:
            return self._device_call(index, query, *args)
        except _DeviceLost:
            return _SKIP

    def _device_call(self, index: int | None, query: str, *args: Any) -> Any:
        """One guarded NVML call on a device: the value or _SKIP; raises _DeviceLost only."""
        if (index, query) in self._unsupported:
            return _SKIP
        fn = getattr(self._nvml, query, None)
        if fn is None:  # older nvidia-ml-py
            self._unsupported.add((index, query))
            self.refused[_refusal_key(index, query)] = "not in this pynvml"
            return _SKIP
        try:
            return fn(*args)
        except self._nvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            if index is not None and code in (
                self._const("NVML_ERROR_GPU_IS_LOST"),
                self._const("NVML_ERROR_UNKNOWN"),
                self._const("NVML_ERROR_RESET_REQUIRED"),
            ):
                raise _DeviceLost(query, f"{type(exc).__name__}: {exc}") from exc
            if code in (
                self._const("NVML_ERROR_NOT_SUPPORTED"),
                self._const("NVML_ERROR_FUNCTION_NOT_FOUND"),
            ):
                self._unsupported.add((index, query))
                self.refused[_refusal_key(index, query)] = f"{type(exc).__name__}: {exc}"
            else:
                self.refused[_refusal_key(index, query)] = f"{type(exc).__name__}: {exc}"
                log.debug("nvml: %s on device %s failed: %s", query, index, exc)
            return _SKIP
        except Exception as exc:  # a binding bug must not stop the other checks
            log.debug("nvml: %s on device %s raised %r", query, index, exc)
            return _SKIP

    def _register_events(self, index: int, handle: Any) -> None:
        """Register the Xid/ECC events this device supports (registering others fails)."""
        self._handles[index] = handle
        if index not in self._pci:
            info = self._device_call(index, "nvmlDeviceGetPciInfo", handle)
            if info is not _SKIP:
                self._pci[index] = pci_key(_text(getattr(info, "busId", "")))
        if self._event_set is None or index in self._registered:
            return
        wanted = (
            self._const("nvmlEventTypeXidCriticalError")
            | self._const("nvmlEventTypeDoubleBitEccError")
            | self._const("nvmlEventTypeSingleBitEccError")
        )
        supported = self._device_call(index, "nvmlDeviceGetSupportedEventTypes", handle)
        if supported is _SKIP:
            return
        mask = int(supported) & wanted
        self._registered[index] = mask
        if (
            mask
            and self._device_call(index, "nvmlDeviceRegisterEvents", handle, mask, self._event_set) is _SKIP
        ):
            self._registered[index] = 0

    # ------------------------------------------------------------------------------ the check

    def _event(
        self,
        kind: EventKind,
        severity: Severity,
        confidence: float,
        message: str,
        now: datetime,
        device: int | None = None,
        **details: str | int | float,
    ) -> HealthEvent:
        # The PCI address lets an Xid seen here be matched with the kernel log's.
        if device is not None and device in self._pci:
            details.setdefault("pci", self._pci[device])
        return super()._event(kind, severity, confidence, message, now, device, **details)

    def _changed(self, kind: str, device: int | None, signature: object | None) -> bool:
        """Edge detection: True when a condition appears or changes; None clears it."""
        key = (kind, device)
        if signature is None:
            self._reported.pop(key, None)
            return False
        if self._reported.get(key) == signature:
            return False
        self._reported[key] = signature
        return True

    def check(self, now: datetime) -> list[HealthEvent]:
        """Events since the previous check; after an init failure one provider-unavailable, then []."""
        with self._lock:
            if self._unavailable is not None:
                if self._unavailable_said:
                    return []
                self._unavailable_said = True
                return [
                    self._event(
                        "provider-unavailable",
                        "info",
                        0.0,
                        f"NVML unavailable on this machine: {self._unavailable}",
                        now,
                        error=self._unavailable,
                    )
                ]
            if self._closed:
                return []
            return self._check(now)

    def _check(self, now: datetime) -> list[HealthEvent]:
        events: list[HealthEvent] = []
        count = self._call(None, "nvmlDeviceGetCount")
        if isinstance(count, int):
            self._last_count = count
        else:
            count = self._last_count  # keep probing the devices we know of
        expected = self.expected_gpus if self.expected_gpus is not None else self._baseline_count
        if isinstance(count, int) and expected is not None and count < expected:
            events.append(
                self._event(
                    "gpu-lost",
                    "critical",
                    1.0,
                    f"{expected - count} of {expected} GPUs missing ({count} visible)",
                    now,
                    expected=expected,
                    found=count,
                    missing=expected - count,
                )
            )
        lost: set[int] = set()
        dbe_devices: set[int] = set()
        events += self._drain_events(now, lost, dbe_devices)
        for index in range(count or 0):
            if index in lost:
                continue
            try:
                handle = self._device_call(index, "nvmlDeviceGetHandleByIndex", index)
                if handle is _SKIP:
                    continue
                self._register_events(index, handle)
                events += self._check_ecc(now, index, handle, index in dbe_devices)
                events += self._check_remap(now, index, handle)
                reasons = self._throttle_reasons(index, handle)
                events += self._check_thermal(now, index, handle, reasons)
                events += self._check_pcie(now, index, handle, reasons)
            except _DeviceLost as exc:
                self._registered.pop(index, None)  # register again if it comes back
                events.append(
                    self._event(
                        "gpu-lost",
                        "critical",
                        1.0,
                        f"GPU {index} stopped answering ({exc.query}: {exc.error})",
                        now,
                        device=index,
                        query=exc.query,
                        error=exc.error,
                    )
                )
        return events

    def _index_of(self, handle: Any) -> int | None:
        """Device index of a handle found in an event (a fresh ctypes object, so compare addresses)."""
        index = self._call(None, "nvmlDeviceGetIndex", handle)
        if isinstance(index, int):
            return index
        address = _address(handle)
        for known_index, known in self._handles.items():
            if known is handle or (address is not None and _address(known) == address):
                return known_index
        return None

    def _drain_events(self, now: datetime, lost: set[int], dbe_devices: set[int]) -> list[HealthEvent]:
        """Read every queued Xid / ECC event without waiting (timeout 0) until NVML says Timeout."""
        if self._event_set is None:
            return []
        wait = getattr(self._nvml, "nvmlEventSetWait_v2", None) or getattr(
            self._nvml, "nvmlEventSetWait", None
        )
        if wait is None:
            return []
        events: list[HealthEvent] = []
        xid_type = self._const("nvmlEventTypeXidCriticalError")
        dbe_type = self._const("nvmlEventTypeDoubleBitEccError")
        sbe_type = self._const("nvmlEventTypeSingleBitEccError")
        for _ in range(self.max_events_per_check):
            try:
                data = wait(self._event_set, 0)
            except self._nvml.NVMLError as exc:
                if getattr(exc, "value", None) != self._const("NVML_ERROR_TIMEOUT"):
                    log.debug("nvml: event wait failed: %s", exc)
                break
            except Exception as exc:
                log.debug("nvml: event wait raised %r", exc)
                break
            index = self._index_of(data.device)
            event_type = int(data.eventType)
            if event_type & xid_type:
                xid = int(data.eventData)
                cls = classify_xid(xid)
                events.append(
                    self._event(
                        "gpu-xid",
                        cls.severity,
                        cls.confidence,
                        f"Xid {xid} on GPU {index}: {cls.meaning}",
                        now,
                        device=index,
                        xid=xid,
                        meaning=cls.meaning,
                    )
                )
                if xid in XID_GPU_LOST and index is not None and index not in lost:
                    lost.add(index)
                    events.append(
                        self._event(
                            "gpu-lost",
                            "critical",
                            1.0,
                            f"GPU {index} fell off the bus (Xid {xid})",
                            now,
                            device=index,
                            xid=xid,
                        )
                    )
            elif event_type & dbe_type:
                if index is not None:
                    dbe_devices.add(index)
                events.append(
                    self._event(
                        "ecc",
                        "critical",
                        1.0,
                        f"double-bit ECC error on GPU {index}",
                        now,
                        device=index,
                        event="double-bit",
                    )
                )
            elif event_type & sbe_type:
                # Corrected by the hardware: counted for the inventory; the uncorrected counter,
                # Xid 92 and row remapping are what say the memory is going bad.
                key = -1 if index is None else index
                self._sbe_events[key] = self._sbe_events.get(key, 0) + 1
        return events

    def _check_ecc(self, now: datetime, index: int, handle: Any, dbe_seen: bool) -> list[HealthEvent]:
        """Volatile uncorrected ECC count going up since the last check."""
        count = self._device_call(
            index,
            "nvmlDeviceGetTotalEccErrors",
            handle,
            self._const("NVML_MEMORY_ERROR_TYPE_UNCORRECTED"),
            self._const("NVML_VOLATILE_ECC"),
        )
        if count is _SKIP:
            return []
        count = int(count)
        previous = self._ecc_last.get(index)
        self._ecc_last[index] = count
        if previous is None or count <= previous or dbe_seen:  # baseline, reset, or already said
            return []
        return [
            self._event(
                "ecc",
                "critical",
                1.0,
                f"{count - previous} new uncorrected ECC errors on GPU {index} ({count} since driver load)",
                now,
                device=index,
                count=count,
                new=count - previous,
            )
        ]

    def _check_remap(self, now: datetime, index: int, handle: Any) -> list[HealthEvent]:
        """Page retirement (pre-Ampere) or row remapping (Ampere+) pending (reset needed) or failed."""
        pending_pages = self._device_call(index, "nvmlDeviceGetRetiredPagesPendingStatus", handle)
        rows = self._device_call(index, "nvmlDeviceGetRemappedRows", handle)
        if pending_pages is _SKIP and rows is _SKIP:
            return []
        pages_pending = pending_pages is not _SKIP and int(pending_pages) == self._const(
            "NVML_FEATURE_ENABLED"
        )
        corr = uncorr = rows_pending = failure = 0
        if rows is not _SKIP:
            corr, uncorr, rows_pending, failure = (int(v) for v in rows)
        if failure:
            signature: tuple[str, ...] | None = ("failure",)
        elif rows_pending or pages_pending:
            signature = ("pending", "rows" if rows_pending else "pages")
        else:
            signature = None
        if not self._changed("row-remap", index, signature):
            return []
        details: dict[str, str | int | float] = {
            "correctable_remapped": corr,
            "uncorrectable_remapped": uncorr,
            "remap_pending": rows_pending,
            "remap_failure": failure,
            "retired_pages_pending": int(pages_pending),
        }
        if failure:
            return [
                self._event(
                    "row-remap",
                    "critical",
                    1.0,
                    f"row remapping failed on GPU {index}: memory can no longer be repaired",
                    now,
                    device=index,
                    **details,
                )
            ]
        return [
            self._event(
                "row-remap",
                "warning",
                0.5,
                f"memory repair pending on GPU {index}: a GPU reset is needed to apply it",
                now,
                device=index,
                **details,
            )
        ]

    def _throttle_reasons(self, index: int, handle: Any) -> int | None:
        reasons = self._device_call(index, "nvmlDeviceGetCurrentClocksEventReasons", handle)
        if reasons is _SKIP:
            reasons = self._device_call(index, "nvmlDeviceGetCurrentClocksThrottleReasons", handle)
        return None if reasons is _SKIP else int(reasons)

    def _check_thermal(
        self, now: datetime, index: int, handle: Any, reasons: int | None
    ) -> list[HealthEvent]:
        """Hot GPU or thermal/HW slowdown; a warning only, confirmed by a throughput drop elsewhere."""
        temperature = self._device_call(
            index, "nvmlDeviceGetTemperature", handle, self._const("NVML_TEMPERATURE_GPU")
        )
        if temperature is _SKIP and reasons is None:
            return []
        if temperature is _SKIP:
            hot = index in self._hot  # no reading: keep the previous verdict
        else:
            limit = self.temperature_threshold_c - (_THERMAL_HYSTERESIS_C if index in self._hot else 0)
            hot = int(temperature) > limit
        if hot:
            self._hot.add(index)
        else:
            self._hot.discard(index)
        active = tuple(
            label for const, label in _THERMAL_REASONS if reasons is not None and reasons & self._const(const)
        )
        signature = (hot, active) if hot or active else None
        if not self._changed("thermal", index, signature):
            return []
        temp_text = "?" if temperature is _SKIP else f"{int(temperature)} C"
        return [
            self._event(
                "thermal",
                "warning",
                0.4,
                f"GPU {index} hot or throttling: {temp_text}, reasons {','.join(active) or 'none'}",
                now,
                device=index,
                temperature_c=-1 if temperature is _SKIP else int(temperature),
                threshold_c=self.temperature_threshold_c,
                reasons=",".join(active),
            )
        ]

    def _check_pcie(self, now: datetime, index: int, handle: Any, reasons: int | None) -> list[HealthEvent]:
        """Link narrower than possible, or slower while busy (an idle GPU lowers its gen to save power)."""
        cur_w = self._device_call(index, "nvmlDeviceGetCurrPcieLinkWidth", handle)
        max_w = self._device_call(index, "nvmlDeviceGetMaxPcieLinkWidth", handle)
        cur_g = self._device_call(index, "nvmlDeviceGetCurrPcieLinkGeneration", handle)
        max_g = self._device_call(index, "nvmlDeviceGetMaxPcieLinkGeneration", handle)
        have_width = cur_w is not _SKIP and max_w is not _SKIP
        have_gen = cur_g is not _SKIP and max_g is not _SKIP
        if not have_width and not have_gen:
            return []
        idle = reasons is not None and bool(reasons & self._const("nvmlClocksEventReasonGpuIdle"))
        degraded: list[str] = []
        if have_width and int(cur_w) < int(max_w):
            degraded.append(f"width x{int(cur_w)} < x{int(max_w)}")
        if have_gen and not idle and int(cur_g) < int(max_g):
            degraded.append(f"gen {int(cur_g)} < {int(max_g)}")
        if not self._changed("pcie-degraded", index, tuple(degraded) or None):
            return []
        return [
            self._event(
                "pcie-degraded",
                "warning",
                0.5,
                f"GPU {index} PCIe link degraded: {'; '.join(degraded)}",
                now,
                device=index,
                width=int(cur_w) if have_width else -1,
                max_width=int(max_w) if have_width else -1,
                gen=int(cur_g) if have_gen else -1,
                max_gen=int(max_g) if have_gen else -1,
            )
        ]

    # ------------------------------------------------------------------------------ inventory

    def read_inventory(self) -> dict[str, Any]:
        """A JSON-ready snapshot of what NVML reports here, to record what a real machine read."""
        with self._lock:
            if self._unavailable is not None:
                return {"available": False, "error": self._unavailable}
            if self._closed:
                return {"available": False, "error": "closed"}
            return self._inventory()

    def _read(self, fn_name: str, *args: Any) -> Any:
        """Inventory read: the value, or {"error": ...} so the snapshot shows what failed."""
        fn = getattr(self._nvml, fn_name, None)
        if fn is None:
            return {"error": "not in this pynvml"}
        try:
            value = fn(*args)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        return _text(value) if isinstance(value, bytes) else value

    def _inventory(self) -> dict[str, Any]:
        nvml = self._nvml
        count = self._read("nvmlDeviceGetCount")
        inventory: dict[str, Any] = {
            "available": True,
            "module": getattr(nvml, "__name__", type(nvml).__name__),
            "module_version": getattr(nvml, "__version__", None) if isinstance(nvml, ModuleType) else None,
            "driver_version": self._read("nvmlSystemGetDriverVersion"),
            "nvml_version": self._read("nvmlSystemGetNVMLVersion"),
            "cuda_driver_version": self._read("nvmlSystemGetCudaDriverVersion"),
            "device_count": count,
            "expected_gpus": self.expected_gpus,
            "baseline_count": self._baseline_count,
            "event_set": self._event_set is not None,
            "refused": dict(self.refused),
            "devices": [],
        }
        for index in range(count if isinstance(count, int) else 0):
            handle = self._read("nvmlDeviceGetHandleByIndex", index)
            if isinstance(handle, dict):
                inventory["devices"].append({"index": index, "handle": handle})
                continue
            inventory["devices"].append(self._device_inventory(index, handle))
        return inventory

    def _device_inventory(self, index: int, handle: Any) -> dict[str, Any]:
        read = self._read
        c = self._const
        device: dict[str, Any] = {"index": index}
        device["name"] = read("nvmlDeviceGetName", handle)
        device["uuid"] = read("nvmlDeviceGetUUID", handle)
        pci = read("nvmlDeviceGetPciInfo", handle)
        device["pci_bus_id"] = pci if isinstance(pci, dict) else _text(getattr(pci, "busId", ""))
        memory = read("nvmlDeviceGetMemoryInfo", handle)
        device["memory"] = (
            memory
            if isinstance(memory, dict)
            else {k: int(getattr(memory, k, 0)) for k in ("total", "used", "free")}
        )
        device["temperature_c"] = read("nvmlDeviceGetTemperature", handle, c("NVML_TEMPERATURE_GPU"))
        device["power_mw"] = read("nvmlDeviceGetPowerUsage", handle)
        device["pstate"] = read("nvmlDeviceGetPerformanceState", handle)
        util = read("nvmlDeviceGetUtilizationRates", handle)
        device["utilization"] = (
            util if isinstance(util, dict) else {"gpu": int(util.gpu), "memory": int(util.memory)}
        )
        ecc_mode = read("nvmlDeviceGetEccMode", handle)
        device["ecc_mode"] = (
            ecc_mode
            if isinstance(ecc_mode, dict)
            else {"current": int(ecc_mode[0]), "pending": int(ecc_mode[1])}
        )
        for label, error_type in (
            ("ecc_volatile_uncorrected", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED"),
            ("ecc_volatile_corrected", "NVML_MEMORY_ERROR_TYPE_CORRECTED"),
        ):
            device[label] = read("nvmlDeviceGetTotalEccErrors", handle, c(error_type), c("NVML_VOLATILE_ECC"))
        device["retired_pages_pending"] = read("nvmlDeviceGetRetiredPagesPendingStatus", handle)
        rows = read("nvmlDeviceGetRemappedRows", handle)
        device["remapped_rows"] = (
            rows
            if isinstance(rows, dict)
            else dict(
                zip(
                    ("correctable", "uncorrectable", "pending", "failure"),
                    (int(v) for v in rows),
                    strict=True,
                )
            )
        )
        reasons = read("nvmlDeviceGetCurrentClocksEventReasons", handle)
        if isinstance(reasons, dict):
            reasons = read("nvmlDeviceGetCurrentClocksThrottleReasons", handle)
        device["clocks_event_reasons"] = reasons
        if isinstance(reasons, int):
            device["clocks_event_reason_names"] = [
                name.removeprefix("nvmlClocksEventReason")
                for name in dir(self._nvml)
                if name.startswith("nvmlClocksEventReason")
                and name not in ("nvmlClocksEventReasonAll", "nvmlClocksEventReasonNone")
                and isinstance(getattr(self._nvml, name), int)
                and reasons & getattr(self._nvml, name)
            ]
        device["pcie"] = {
            "gen": read("nvmlDeviceGetCurrPcieLinkGeneration", handle),
            "max_gen": read("nvmlDeviceGetMaxPcieLinkGeneration", handle),
            "width": read("nvmlDeviceGetCurrPcieLinkWidth", handle),
            "max_width": read("nvmlDeviceGetMaxPcieLinkWidth", handle),
        }
        device["supported_event_types"] = read("nvmlDeviceGetSupportedEventTypes", handle)
        device["registered_event_types"] = self._registered.get(index)
        device["single_bit_ecc_events_seen"] = self._sbe_events.get(index, 0)
        return device

    # ------------------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Free the event set and shut NVML down (once)."""
        with self._lock:
            if self._closed or not self._ready:
                self._closed = True
                return
            self._closed = True
            if self._event_set is not None:
                try:
                    self._nvml.nvmlEventSetFree(self._event_set)
                except Exception as exc:
                    log.debug("nvml: event set free failed: %s", exc)
                self._event_set = None
            try:
                self._nvml.nvmlShutdown()
            except Exception as exc:
                log.debug("nvml: shutdown failed: %s", exc)
