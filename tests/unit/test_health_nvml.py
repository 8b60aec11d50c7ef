"""NvmlProbe against a pynvml stand-in with the real constants, error classes and signatures."""

from __future__ import annotations

import inspect
import json
from datetime import UTC, datetime, timedelta

import pynvml
import pytest

from tests.unit.fake_pynvml import FakeGpu, FakeNvml
from trainguard.agent.health.events import HealthEvent
from trainguard.agent.health.nvml import XID_CLASSES, XID_DEFAULT, NvmlProbe, classify_xid, pci_key

T0 = datetime(2025, 1, 1, tzinfo=UTC)


def at(i: int) -> datetime:
    return T0 + timedelta(seconds=2 * i)


def gpus(n: int) -> list[FakeGpu]:
    return [FakeGpu(uuid=f"GPU-{i}", bus_id=f"00000000:{0x18 + i:02X}:00.0") for i in range(n)]


def kinds(events: list[HealthEvent]) -> list[str]:
    return [e.kind for e in events]


def only(events: list[HealthEvent], kind: str) -> HealthEvent:
    matching = [e for e in events if e.kind == kind]
    assert len(matching) == 1, events
    return matching[0]


def test_fake_follows_the_real_signatures() -> None:
    fake = FakeNvml()
    names = [n for n in dir(fake) if n.startswith("nvml") and callable(getattr(fake, n))]
    assert len(names) > 25
    for name in names:
        real = getattr(pynvml, name, None)
        assert real is not None, f"{name} is not in pynvml"
        if not inspect.isfunction(real):
            continue  # constants copied from pynvml
        assert inspect.signature(getattr(fake, name)) == inspect.signature(inspect.unwrap(real)), name


@pytest.mark.parametrize(
    "code",
    [
        pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
        pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
        pynvml.NVML_ERROR_NO_PERMISSION,
    ],
)
def test_library_missing_says_so_once_then_never_calls_nvml(code: int) -> None:
    fake = FakeNvml(init_error=code)
    probe = NvmlProbe("node-1", 8, nvml=fake)
    first = probe.check(at(0))
    assert len(first) == 1
    event = first[0]
    assert (event.kind, event.severity, event.confidence, event.source) == (
        "provider-unavailable",
        "info",
        0.0,
        "nvml",
    )
    assert type(pynvml.NVMLError(code)).__name__ in event.message
    for i in range(1, 4):
        assert probe.check(at(i)) == []
    assert probe.read_inventory()["available"] is False
    probe.close()
    assert fake.calls == ["nvmlInit"]


def test_the_real_module_here_either_works_or_is_unavailable_once() -> None:
    probe = NvmlProbe("node-1", None)
    try:
        first = probe.check(at(0))
        if probe.available:  # a GPU machine
            assert all(e.kind != "provider-unavailable" for e in first)
            assert probe.read_inventory()["available"] is True
        else:
            assert kinds(first) == ["provider-unavailable"]
            assert probe.check(at(1)) == []
    finally:
        probe.close()


def test_healthy_machine_reports_nothing() -> None:
    probe = NvmlProbe("node-1", 2, nvml=FakeNvml(gpus(2)))
    assert probe.check(at(0)) == []
    assert probe.check(at(1)) == []


def test_xid_79_is_critical_and_the_gpu_is_lost() -> None:
    fake = FakeNvml(gpus(2))
    probe = NvmlProbe("node-1", 2, nvml=fake)
    fake.push_xid(1, 79)
    events = probe.check(at(0))
    xid = only(events, "gpu-xid")
    assert (xid.severity, xid.confidence, xid.device, xid.details["xid"]) == ("critical", 1.0, 1, 79)
    assert xid.details["pci"] == "0000:19:00"  # the kernel log's spelling, to match host.py's Xids
    assert "fallen off the bus" in xid.message
    assert only(events, "gpu-lost").device == 1
    # The driver then answers GPU_IS_LOST for that device: gpu-lost repeats while it stands.
    fake.gpus[1].lost = True
    for i in (1, 2):
        events = probe.check(at(i))
        assert kinds(events) == ["gpu-lost"]
        assert events[0].device == 1 and events[0].details["error"].startswith("NVMLError_GpuIsLost")


def test_xid_13_is_an_application_fault_with_low_confidence() -> None:
    fake = FakeNvml(gpus(1))
    probe = NvmlProbe("node-1", 1, nvml=fake)
    fake.push_xid(0, 13)
    fake.push_xid(0, 31)
    fake.push_xid(0, 9999)
    events = probe.check(at(0))
    assert [(e.details["xid"], e.severity, e.confidence) for e in events] == [
        (13, "warning", 0.3),
        (31, "warning", 0.3),
        (9999, "warning", 0.6),
    ]
    assert probe.check(at(1)) == []  # drained


def test_xid_table() -> None:
    for xid in (48, 63, 64, 74, 79, 92, 94, 95, 119, 120):
        assert classify_xid(xid)[:2] == ("critical", 1.0)
    for xid in (13, 31, 43, 45):
        assert classify_xid(xid)[:2] == ("warning", 0.3)
    assert classify_xid(12345) is XID_DEFAULT
    assert all(c.meaning for c in XID_CLASSES.values())


def test_pci_key_matches_nvml_and_kernel_spellings() -> None:
    assert pci_key("00000000:3B:00.0") == pci_key("0000:3b:00") == pci_key("3b:00") == "0000:3b:00"
    assert pci_key("garbage") == "garbage"


def test_only_supported_event_types_are_registered() -> None:
    fake = FakeNvml(
        [FakeGpu(supported_events=pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypePState)]
    )
    probe = NvmlProbe("node-1", 1, nvml=fake)
    (event_set,) = fake.event_sets
    assert list(event_set.registered.values()) == [pynvml.nvmlEventTypeXidCriticalError]
    fake.push_xid(0, 48)
    assert kinds(probe.check(at(0))) == ["gpu-xid"]


def test_event_device_is_found_by_address_when_get_index_fails() -> None:
    fake = FakeNvml(gpus(3))
    fake.errors["nvmlDeviceGetIndex"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    probe = NvmlProbe("node-1", 3, nvml=fake)
    fake.push_xid(2, 74)
    assert only(probe.check(at(0)), "gpu-xid").device == 2


def test_single_bit_ecc_events_are_counted_not_reported() -> None:
    fake = FakeNvml(gpus(1))
    probe = NvmlProbe("node-1", 1, nvml=fake)
    fake.push_event(0, pynvml.nvmlEventTypeSingleBitEccError)
    assert probe.check(at(0)) == []
    assert probe.read_inventory()["devices"][0]["single_bit_ecc_events_seen"] == 1


def test_uncorrected_ecc_increase_is_reported_once() -> None:
    fake = FakeNvml(gpus(2))
    probe = NvmlProbe("node-1", 2, nvml=fake)
    assert probe.check(at(0)) == []  # baseline
    fake.gpus[1].ecc_uncorrected_volatile = 2
    event = only(probe.check(at(1)), "ecc")
    assert (event.severity, event.confidence, event.device) == ("critical", 1.0, 1)
    assert (event.details["count"], event.details["new"]) == (2, 2)
    assert probe.check(at(2)) == []  # unchanged
    fake.gpus[1].ecc_uncorrected_volatile = 3
    assert only(probe.check(at(3)), "ecc").details["new"] == 1


def test_double_bit_event_and_counter_give_one_ecc_event() -> None:
    fake = FakeNvml(gpus(1))
    probe = NvmlProbe("node-1", 1, nvml=fake)
    probe.check(at(0))
    fake.gpus[0].ecc_uncorrected_volatile = 1
    fake.push_event(0, pynvml.nvmlEventTypeDoubleBitEccError)
    assert kinds(probe.check(at(1))) == ["ecc"]
    assert probe.check(at(2)) == []


def test_ecc_not_supported_is_skipped_and_not_asked_again() -> None:
    fake = FakeNvml([FakeGpu(errors={"nvmlDeviceGetTotalEccErrors": pynvml.NVML_ERROR_NOT_SUPPORTED})])
    probe = NvmlProbe("node-1", 1, nvml=fake)
    for i in range(3):
        assert probe.check(at(i)) == []
    assert fake.calls.count("nvmlDeviceGetTotalEccErrors") == 1


def test_fewer_devices_than_expected_is_gpu_lost_every_check() -> None:
    fake = FakeNvml(gpus(7))
    probe = NvmlProbe("node-1", 8, nvml=fake)
    for i in range(3):
        event = only(probe.check(at(i)), "gpu-lost")
        assert (event.severity, event.confidence, event.device) == ("critical", 1.0, None)
        assert (event.details["expected"], event.details["found"], event.details["missing"]) == (8, 7, 1)


def test_expected_defaults_to_the_count_seen_at_start() -> None:
    fake = FakeNvml(gpus(4))
    probe = NvmlProbe("node-1", None, nvml=fake)
    assert probe.check(at(0)) == []
    del fake.gpus[3]
    assert only(probe.check(at(1)), "gpu-lost").details["missing"] == 1


@pytest.mark.parametrize(
    ("query", "code"),
    [
        ("nvmlDeviceGetTemperature", pynvml.NVML_ERROR_GPU_IS_LOST),
        ("nvmlDeviceGetHandleByIndex", pynvml.NVML_ERROR_GPU_IS_LOST),
        ("nvmlDeviceGetRemappedRows", pynvml.NVML_ERROR_UNKNOWN),
    ],
)
def test_a_device_query_saying_gpu_is_lost_is_gpu_lost(query: str, code: int) -> None:
    fake = FakeNvml(gpus(2))
    probe = NvmlProbe("node-1", 2, nvml=fake)
    assert probe.check(at(0)) == []
    fake.gpus[0].errors[query] = code
    for i in (1, 2):
        event = only(probe.check(at(i)), "gpu-lost")
        assert (event.device, event.details["query"], event.severity) == (0, query, "critical")


@pytest.mark.parametrize("query", ["nvmlDeviceGetPciInfo", "nvmlDeviceGetSupportedEventTypes", None])
def test_a_gpu_lost_before_the_probe_starts_is_reported_by_the_first_check(query: str | None) -> None:
    fake = FakeNvml(gpus(2))
    if query is None:
        fake.gpus[1].lost = True
    else:
        fake.gpus[1].errors[query] = pynvml.NVML_ERROR_GPU_IS_LOST
    probe = NvmlProbe("node-1", 2, nvml=fake)
    assert only(probe.check(at(0)), "gpu-lost").device == 1


def test_row_remap_pending_then_failure() -> None:
    fake = FakeNvml(gpus(1))
    probe = NvmlProbe("node-1", 1, nvml=fake)
    fake.gpus[0].remapped_rows = (0, 1, 1, 0)
    event = only(probe.check(at(0)), "row-remap")
    assert (event.severity, event.confidence, event.details["remap_pending"]) == ("warning", 0.5, 1)
    assert probe.check(at(1)) == []
    fake.gpus[0].remapped_rows = (0, 1, 0, 1)
    event = only(probe.check(at(2)), "row-remap")
    assert (event.severity, event.confidence, event.details["remap_failure"]) == ("critical", 1.0, 1)
    assert probe.check(at(3)) == []


def test_retired_pages_pending_on_a_pre_ampere_gpu() -> None:
    gpu = FakeGpu(
        retired_pages_pending=pynvml.NVML_FEATURE_ENABLED,
        errors={"nvmlDeviceGetRemappedRows": pynvml.NVML_ERROR_NOT_SUPPORTED},
    )
    probe = NvmlProbe("node-1", 1, nvml=FakeNvml([gpu]))
    event = only(probe.check(at(0)), "row-remap")
    assert (event.severity, event.details["retired_pages_pending"]) == ("warning", 1)


def test_pcie_width_degraded_once_and_gen_only_when_busy() -> None:
    fake = FakeNvml(gpus(1))
    probe = NvmlProbe("node-1", 1, nvml=fake)
    fake.gpus[0].pcie_width = (8, 16)
    event = only(probe.check(at(0)), "pcie-degraded")
    assert (event.severity, event.confidence, event.details["width"], event.details["max_width"]) == (
        "warning",
        0.5,
        8,
        16,
    )
    assert probe.check(at(1)) == []
    fake.gpus[0].pcie_width = (16, 16)
    assert probe.check(at(2)) == []  # cleared
    # An idle GPU drops its link generation to save power: not a fault.
    fake.gpus[0].pcie_gen = (1, 5)
    fake.gpus[0].clocks_event_reasons = pynvml.nvmlClocksEventReasonGpuIdle
    assert probe.check(at(3)) == []
    fake.gpus[0].clocks_event_reasons = 0
    event = only(probe.check(at(4)), "pcie-degraded")
    assert (event.details["gen"], event.details["max_gen"]) == (1, 5)


def test_thermal_once_with_hysteresis_and_throttle_reasons() -> None:
    fake = FakeNvml(gpus(1))
    probe = NvmlProbe("node-1", 1, nvml=fake, temperature_threshold_c=90)
    fake.gpus[0].temperature = 95
    event = only(probe.check(at(0)), "thermal")
    assert (event.severity, event.confidence, event.details["temperature_c"]) == ("warning", 0.4, 95)
    assert probe.check(at(1)) == []
    fake.gpus[0].temperature = 89  # within the hysteresis band: still hot, not said again
    assert probe.check(at(2)) == []
    fake.gpus[0].temperature = 70
    assert probe.check(at(3)) == []
    fake.gpus[0].clocks_event_reasons = pynvml.nvmlClocksEventReasonHwThermalSlowdown | 0x4  # + power cap
    assert only(probe.check(at(4)), "thermal").details["reasons"] == "hw_thermal"
    fake.gpus[0].clocks_event_reasons |= pynvml.nvmlClocksEventReasonHwSlowdown
    assert only(probe.check(at(5)), "thermal").details["reasons"] == "hw_slowdown,hw_thermal"


def test_thermal_falls_back_to_the_older_throttle_reasons_call() -> None:
    gpu = FakeGpu(
        clocks_event_reasons=pynvml.nvmlClocksThrottleReasonSwThermalSlowdown,
        errors={"nvmlDeviceGetCurrentClocksEventReasons": pynvml.NVML_ERROR_FUNCTION_NOT_FOUND},
    )
    probe = NvmlProbe("node-1", 1, nvml=FakeNvml([gpu]))
    assert only(probe.check(at(0)), "thermal").details["reasons"] == "sw_thermal"


def test_an_unexpected_error_in_one_query_does_not_stop_the_others() -> None:
    fake = FakeNvml(gpus(2))
    probe = NvmlProbe("node-1", 2, nvml=fake)
    assert probe.check(at(0)) == []
    fake.errors["nvmlEventSetWait_v2"] = pynvml.NVML_ERROR_UNKNOWN
    fake.gpus[0].errors = {
        "nvmlDeviceGetTotalEccErrors": pynvml.NVML_ERROR_NO_PERMISSION,
        "nvmlDeviceGetRemappedRows": pynvml.NVML_ERROR_MEMORY,
        "nvmlDeviceGetCurrentClocksEventReasons": pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES,
    }
    fake.gpus[0].temperature = 99
    fake.gpus[0].pcie_width = (4, 16)
    fake.gpus[1].remapped_rows = (0, 0, 0, 1)
    events = probe.check(at(1))
    assert sorted((e.kind, e.device) for e in events) == [
        ("pcie-degraded", 0),
        ("row-remap", 1),
        ("thermal", 0),
    ]
    # Transient errors are asked again next time (only NOT_SUPPORTED is remembered).
    calls = fake.calls.count("nvmlDeviceGetTotalEccErrors")
    probe.check(at(2))
    assert fake.calls.count("nvmlDeviceGetTotalEccErrors") == calls + 2


def test_inventory_is_json_and_names_what_failed() -> None:
    fake = FakeNvml(gpus(2))
    fake.gpus[1].errors["nvmlDeviceGetPowerUsage"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    probe = NvmlProbe("node-1", 2, nvml=fake)
    inventory = json.loads(json.dumps(probe.read_inventory()))
    assert inventory["available"] is True
    assert inventory["driver_version"] == "570.86.15"
    assert inventory["device_count"] == 2
    first, second = inventory["devices"]
    assert first["name"] == "NVIDIA H100 80GB HBM3"
    assert first["pci_bus_id"] == "00000000:18:00.0"
    assert first["memory"]["total"] == 80 << 30
    assert first["pcie"] == {"gen": 5, "max_gen": 5, "width": 16, "max_width": 16}
    assert first["remapped_rows"] == {"correctable": 0, "uncorrectable": 0, "pending": 0, "failure": 0}
    assert first["registered_event_types"] == (
        pynvml.nvmlEventTypeXidCriticalError
        | pynvml.nvmlEventTypeDoubleBitEccError
        | pynvml.nvmlEventTypeSingleBitEccError
    )
    assert second["power_mw"]["error"].startswith("NVMLError_NotSupported")
    fake.gpus[1].lost = True
    assert "GpuIsLost" in json.dumps(probe.read_inventory()["devices"][1])


def test_close_frees_the_event_set_and_shuts_nvml_down_once() -> None:
    fake = FakeNvml(gpus(1))
    probe = NvmlProbe("node-1", 1, nvml=fake)
    probe.close()
    probe.close()
    assert fake.calls.count("nvmlShutdown") == 1
    assert fake.event_sets[0].freed and fake.initialised == 0
    assert probe.check(at(0)) == []
