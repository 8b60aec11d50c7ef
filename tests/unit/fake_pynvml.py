"""A stand-in for the ``pynvml`` module that follows the real API, so NvmlProbe is tested without a GPU.

Constants, error classes and ctypes structures are the real module's (imported from pynvml), so an
error raised here is exactly the class a driver would produce (``NVMLError(NVML_ERROR_TIMEOUT)`` is an
``NVMLError_Timeout``) and handles are real ``c_nvmlDevice_t`` pointers: an event's ``device`` is a
fresh pointer object, as with the driver, not the object the probe holds. Only the functions are
fake, with the real signatures (a test checks them against pynvml).
"""

from __future__ import annotations

import ctypes
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import pynvml

_COPIED_PREFIXES = (
    "NVML_",
    "NVMLError",
    "nvmlEventType",
    "nvmlClocksEventReason",
    "nvmlClocksThrottleReason",
    "c_nvml",
    "struct_c_nvml",
    "nvmlPciInfo_t",
)
GIB = 1 << 30


def _err(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


@dataclass
class FakeGpu:
    """What one GPU reports; tests change fields between checks."""

    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    bus_id: str = "00000000:3B:00.0"
    temperature: int = 45
    ecc_uncorrected_volatile: int = 0
    ecc_corrected_volatile: int = 0
    ecc_mode: tuple[int, int] = (1, 1)
    retired_pages_pending: int = pynvml.NVML_FEATURE_DISABLED
    remapped_rows: tuple[int, int, int, int] = (0, 0, 0, 0)  # corr, uncorr, pending, failure
    clocks_event_reasons: int = 0
    pcie_gen: tuple[int, int] = (5, 5)  # current, max
    pcie_width: tuple[int, int] = (16, 16)  # current, max
    supported_events: int = (
        pynvml.nvmlEventTypeXidCriticalError
        | pynvml.nvmlEventTypeDoubleBitEccError
        | pynvml.nvmlEventTypeSingleBitEccError
    )
    memory_total: int = 80 * GIB
    memory_used: int = 1 * GIB
    power_mw: int = 70_000
    lost: bool = False  # every query raises NVMLError_GpuIsLost (fell off the bus)
    errors: dict[str, int] = field(default_factory=dict)  # function name -> NVML_ERROR_* code to raise
    # Opaque storage the handle points at (a real handle is a pointer into the driver's table).
    storage: Any = field(default_factory=pynvml.struct_c_nvmlDevice_t, repr=False)


class FakeEventSet:
    """What nvmlEventSetCreate returns: the registrations and the queued events."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}  # storage address -> event mask
        self.queue: deque[pynvml.c_nvmlEventData_t] = deque()
        self.freed = False


class FakeNvml:
    """The module object handed to NvmlProbe(nvml=...)."""

    def __init__(self, gpus: list[FakeGpu] | None = None, init_error: int | None = None) -> None:
        self.__name__ = "fake_pynvml"
        self.gpus: list[FakeGpu] = gpus if gpus is not None else [FakeGpu()]
        self.init_error = init_error
        self.errors: dict[str, int] = {}  # function name -> code, for calls that take no handle
        self.calls: list[str] = []
        self.initialised = 0
        self.event_sets: list[FakeEventSet] = []

    # ------------------------------------------------------------------ test controls

    def push_event(self, index: int, event_type: int, event_data: int = 0) -> None:
        """Queue an event as the driver would; it reaches only sets registered for that type."""
        gpu = self.gpus[index]
        for event_set in self.event_sets:
            if event_set.registered.get(ctypes.addressof(gpu.storage), 0) & event_type:
                data = pynvml.c_nvmlEventData_t()
                data.device = ctypes.pointer(gpu.storage)
                data.eventType = event_type
                data.eventData = event_data
                event_set.queue.append(data)

    def push_xid(self, index: int, xid: int) -> None:
        self.push_event(index, pynvml.nvmlEventTypeXidCriticalError, xid)

    # ------------------------------------------------------------------ plumbing

    def _enter(self, name: str) -> None:
        self.calls.append(name)
        if not self.initialised:
            raise _err(pynvml.NVML_ERROR_UNINITIALIZED)
        if name in self.errors:
            raise _err(self.errors[name])

    def _gpu(self, name: str, handle: Any) -> FakeGpu:
        self._enter(name)
        address = ctypes.addressof(handle.contents)
        for gpu in self.gpus:
            if ctypes.addressof(gpu.storage) == address:
                if gpu.lost:
                    raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
                if name in gpu.errors:
                    raise _err(gpu.errors[name])
                return gpu
        raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    # ------------------------------------------------------------------ the API (real signatures)

    def nvmlInit(self):
        self.calls.append("nvmlInit")
        if self.init_error is not None:
            raise _err(self.init_error)
        self.initialised += 1

    def nvmlShutdown(self):
        self._enter("nvmlShutdown")
        self.initialised -= 1

    def nvmlSystemGetDriverVersion(self):
        self._enter("nvmlSystemGetDriverVersion")
        return "570.86.15"

    def nvmlSystemGetNVMLVersion(self):
        self._enter("nvmlSystemGetNVMLVersion")
        return "12.570.86.15"

    def nvmlSystemGetCudaDriverVersion(self):
        self._enter("nvmlSystemGetCudaDriverVersion")
        return 12080

    def nvmlDeviceGetCount(self):
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[index]
        if gpu.lost:
            raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
        if "nvmlDeviceGetHandleByIndex" in gpu.errors:
            raise _err(gpu.errors["nvmlDeviceGetHandleByIndex"])
        return ctypes.pointer(gpu.storage)

    def nvmlDeviceGetIndex(self, handle):
        gpu = self._gpu("nvmlDeviceGetIndex", handle)
        return self.gpus.index(gpu)

    def nvmlDeviceGetName(self, handle):
        return self._gpu("nvmlDeviceGetName", handle).name

    def nvmlDeviceGetUUID(self, handle):
        return self._gpu("nvmlDeviceGetUUID", handle).uuid

    def nvmlDeviceGetPciInfo(self, handle):
        gpu = self._gpu("nvmlDeviceGetPciInfo", handle)
        info = pynvml.nvmlPciInfo_t()
        info.busId = gpu.bus_id.encode()
        return info

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        gpu = self._gpu("nvmlDeviceGetMemoryInfo", handle)
        memory = pynvml.c_nvmlMemory_t()
        memory.total = gpu.memory_total
        memory.used = gpu.memory_used
        memory.free = gpu.memory_total - gpu.memory_used
        return memory

    def nvmlDeviceGetTemperature(self, handle, sensor):
        gpu = self._gpu("nvmlDeviceGetTemperature", handle)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.temperature

    def nvmlDeviceGetPowerUsage(self, handle):
        return self._gpu("nvmlDeviceGetPowerUsage", handle).power_mw

    def nvmlDeviceGetPerformanceState(self, handle):
        self._gpu("nvmlDeviceGetPerformanceState", handle)
        return 0

    def nvmlDeviceGetUtilizationRates(self, handle):
        self._gpu("nvmlDeviceGetUtilizationRates", handle)
        util = pynvml.c_nvmlUtilization_t()
        util.gpu = 97
        util.memory = 40
        return util

    def nvmlDeviceGetEccMode(self, handle):
        return list(self._gpu("nvmlDeviceGetEccMode", handle).ecc_mode)

    def nvmlDeviceGetTotalEccErrors(self, handle, errorType, counterType):
        gpu = self._gpu("nvmlDeviceGetTotalEccErrors", handle)
        if counterType != pynvml.NVML_VOLATILE_ECC:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if errorType == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
            return gpu.ecc_uncorrected_volatile
        if errorType == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED:
            return gpu.ecc_corrected_volatile
        raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, device):
        return self._gpu("nvmlDeviceGetRetiredPagesPendingStatus", device).retired_pages_pending

    def nvmlDeviceGetRemappedRows(self, device):
        return tuple(self._gpu("nvmlDeviceGetRemappedRows", device).remapped_rows)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return self._gpu("nvmlDeviceGetCurrentClocksEventReasons", handle).clocks_event_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle):
        return self._gpu("nvmlDeviceGetCurrentClocksThrottleReasons", handle).clocks_event_reasons

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle):
        return self._gpu("nvmlDeviceGetCurrPcieLinkGeneration", handle).pcie_gen[0]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle):
        return self._gpu("nvmlDeviceGetMaxPcieLinkGeneration", handle).pcie_gen[1]

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle):
        return self._gpu("nvmlDeviceGetCurrPcieLinkWidth", handle).pcie_width[0]

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle):
        return self._gpu("nvmlDeviceGetMaxPcieLinkWidth", handle).pcie_width[1]

    def nvmlDeviceGetSupportedEventTypes(self, handle):
        return self._gpu("nvmlDeviceGetSupportedEventTypes", handle).supported_events

    def nvmlEventSetCreate(self):
        self._enter("nvmlEventSetCreate")
        event_set = FakeEventSet()
        self.event_sets.append(event_set)
        return event_set

    def nvmlDeviceRegisterEvents(self, handle, eventTypes, eventSet):
        gpu = self._gpu("nvmlDeviceRegisterEvents", handle)
        if eventTypes & ~gpu.supported_events:  # the driver refuses a mask with unsupported types
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        address = ctypes.addressof(gpu.storage)
        eventSet.registered[address] = eventSet.registered.get(address, 0) | eventTypes

    def nvmlEventSetWait_v2(self, eventSet, timeoutms):
        self._enter("nvmlEventSetWait_v2")
        if eventSet.freed:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not eventSet.queue:
            raise _err(pynvml.NVML_ERROR_TIMEOUT)  # the probe waits 0 ms: nothing queued
        return eventSet.queue.popleft()

    def nvmlEventSetWait(self, eventSet, timeoutms):
        return self.nvmlEventSetWait_v2(eventSet, timeoutms)

    def nvmlEventSetFree(self, eventSet):
        self._enter("nvmlEventSetFree")
        eventSet.freed = True


for _name in dir(pynvml):
    if _name.startswith(_COPIED_PREFIXES):
        setattr(FakeNvml, _name, getattr(pynvml, _name))
