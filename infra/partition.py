"""Network partitions inside a netns stack's namespaces: nftables rules that drop traffic.

Each cut is one nftables table (``tgcut``) inside one machine's namespace, so nothing outside the
namespaces the stack created is touched and ``heal`` removes exactly what ``cut`` added. Temporal
and S3 are relayed on the same bridge address but on their own ports, so a rule matching the port
cuts one without the other; a peer is cut by its namespace address (both directions, dropped in
the cut machine's namespace: the other side sees the same silence). Packets are dropped, not
rejected: established connections stall as on a real partition, nobody hears a reset.

Needs root and nftables' ``nft`` (``apt-get install -y nftables``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Literal

from infra import netns
from infra.apt import apt_install
from infra.stack import StackConfig

TABLE = "tgcut"
Target = Literal["temporal", "s3"]


class PartitionError(RuntimeError):
    """nft is missing, or an nft command failed."""


def unavailable_reason() -> str | None:
    """Why partitions cannot be made here, or None."""
    reason = netns.unavailable_reason()
    if reason is not None:
        return reason
    if shutil.which("nft") is None and not _install_nftables():
        return "partitions need nftables' `nft` on PATH (apt-get install -y nftables)"
    return None


def _install_nftables() -> bool:
    """apt-get nftables (after one `apt-get update`) where this process may (root): CI's fresh
    machine has the namespaces' tools but not nft."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return False
    try:
        apt_install(["nftables"], timeout_s=600)
    except RuntimeError:
        return False
    return shutil.which("nft") is not None


def _nft(plan: netns.NetnsPlan, node: str, script: str, check: bool = True) -> None:
    argv = [*netns.exec_prefix(plan, node), "nft", "-f", "-"]
    proc = subprocess.run(argv, input=script, capture_output=True, text=True, check=False, timeout=30)
    if check and proc.returncode != 0:
        raise PartitionError(f"nft in {plan.node(node).namespace} failed: {proc.stderr.strip()}")


def _matches(plan: netns.NetnsPlan, cfg: StackConfig, what: Target | str) -> tuple[str, str]:
    """(outgoing, incoming) nft match expressions of one target."""
    if what == "temporal":
        return (
            f"ip daddr {plan.bridge_ip} tcp dport {cfg.temporal_port}",
            f"ip saddr {plan.bridge_ip} tcp sport {cfg.temporal_port}",
        )
    if what == "s3":
        return (
            f"ip daddr {plan.bridge_ip} tcp dport {cfg.s3_port}",
            f"ip saddr {plan.bridge_ip} tcp sport {cfg.s3_port}",
        )
    peer = plan.node(what).ip  # another machine of the stack
    return f"ip daddr {peer}", f"ip saddr {peer}"


def cut(plan: netns.NetnsPlan, cfg: StackConfig, node: str, targets: list[Target | str]) -> None:
    """Drop every packet between ``node`` and each target (``temporal``, ``s3`` or a machine's
    name), replacing any cut already on ``node``."""
    rules_out, rules_in = [], []
    for t in targets:
        out, inc = _matches(plan, cfg, t)
        rules_out.append(f"    {out} drop")
        rules_in.append(f"    {inc} drop")
    script = "\n".join(
        [
            f"table inet {TABLE}",
            f"delete table inet {TABLE}",
            f"table inet {TABLE} {{",
            "  chain out {",
            "    type filter hook output priority 0; policy accept;",
            *rules_out,
            "  }",
            "  chain in {",
            "    type filter hook input priority 0; policy accept;",
            *rules_in,
            "  }",
            "}",
            "",
        ]
    )
    _nft(plan, node, script)


def heal(plan: netns.NetnsPlan, node: str) -> None:
    """Remove ``node``'s cut, if any."""
    _nft(plan, node, f"table inet {TABLE}\ndelete table inet {TABLE}\n")


def heal_all(plan: netns.NetnsPlan) -> None:
    for name in plan.nodes:
        heal(plan, name)
