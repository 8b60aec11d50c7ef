"""Run the real NvmlProbe on this machine and print what it reads, as JSON.

On a machine without the NVIDIA driver this prints ``available: false`` and one
``provider-unavailable`` event; on a GPU machine it records the inventory (driver, devices, ECC,
PCIe, throttle reasons) and the events of a few checks, with how long each check took, so the
probe's behaviour on real hardware can be compared with the fake used in the unit tests.

    python bench/nvml_probe.py [--expected-gpus N] [--checks 3] [--interval 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainguard.agent.health.nvml import NvmlProbe


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--node", default=platform.node())
    parser.add_argument("--expected-gpus", type=int, default=None)
    parser.add_argument("--checks", type=int, default=1, help="rounds of check()")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between rounds")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()

    try:
        binding = metadata.version("nvidia-ml-py")
    except metadata.PackageNotFoundError:
        binding = None
    started = time.perf_counter()
    probe = NvmlProbe(args.node, args.expected_gpus)
    init_ms = (time.perf_counter() - started) * 1000
    try:
        inventory = probe.read_inventory()
        rounds = []
        for i in range(args.checks):
            if i:
                time.sleep(args.interval)
            t0 = time.perf_counter()
            events = probe.check(datetime.now(UTC))
            rounds.append(
                {
                    "check_ms": round((time.perf_counter() - t0) * 1000, 3),
                    "events": [e.model_dump(mode="json") for e in events],
                }
            )
    finally:
        probe.close()
    report = {
        "node": args.node,
        "at": datetime.now(UTC).isoformat(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "nvidia_ml_py": binding,
        "available": probe.available or bool(inventory.get("available")),
        "init_ms": round(init_ms, 3),
        "inventory": inventory,
        "checks": rounds,
    }
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
