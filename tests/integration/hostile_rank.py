"""A training script that, before it trains, tries what a hostile one would on its machine:
find the cluster's keys (its own environment, every process's, the agent's files), then use
whatever it found, or nothing, against another job's checkpoints and against Temporal.

Each attempt is one line of the JSON report it prints (``HOSTILE {...}``): what it tried and
whether the machine let it. Then it trains a small model as any script does, saving into
``--ckpt-dir`` every ``--ckpt-every`` steps, so its own checkpoints and output must reach S3
through its agent as before. Run by tests/integration/test_hostile_rank.py.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
from pathlib import Path
from typing import Any

import torch

# What an agent's environment or files would betray.
MARKERS = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_ACCESS_KEY_ID",
    "TRAINGUARD_TEMPORAL",
    "TRAINGUARD_S3",
    "TRAINGUARD_IDENTITY",
    "secretKey",
)
BUCKET, PREFIX = "trainguard", "checkpoints/"  # the defaults: an attacker's first guess
report: dict[str, Any] = {"uid": os.getuid(), "found": [], "allowed": [], "denied": []}


def attempt(what: str, fn: Any) -> Any:
    """Run one attack; it is 'allowed' if it returns without an error."""
    try:
        out = fn()
    except Exception as exc:  # every refusal looks different: permission, refused, access denied
        report["denied"].append(f"{what}: {type(exc).__name__}")
        return None
    report["allowed"].append(what)
    return out


def proc_pids() -> list[int]:
    return sorted(int(p) for p in os.listdir("/proc") if p.isdigit())


def ancestors() -> list[int]:
    out, pid = [], os.getppid()
    while pid > 1:
        out.append(pid)
        stat = Path(f"/proc/{pid}/stat").read_text()
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return out


def look_for_keys() -> tuple[dict[str, list[int]], list[Path]]:
    """Credentials anywhere this process can read; the servers' ports and the files the others'
    command lines give away (world-readable, as on any Linux host)."""
    own = sorted(k for k in os.environ if k.startswith(("AWS_", "TRAINGUARD_", "TEMPORAL_")))
    report["found"] += [f"own environment: {k}" for k in own]
    for pid in ancestors():
        data = attempt(
            f"read environ of ancestor {pid}", lambda p=pid: Path(f"/proc/{p}/environ").read_bytes()
        )
        if data and any(m.encode() in data for m in MARKERS):
            report["found"].append(f"credentials in ancestor {pid}'s environment")
    ports: dict[str, list[int]] = {"temporal": [], "s3": []}
    files: list[Path] = []
    for pid in proc_pids():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            environ = b""
        if any(m.encode() in environ for m in MARKERS):
            report["found"].append(f"credentials in process {pid}'s environment")
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        for arg, value in itertools.pairwise(argv):
            if arg == "--port" and any(a.endswith("temporal") for a in argv[:1]):
                ports["temporal"].append(int(value))
            elif arg == "-s3.port":
                ports["s3"].append(int(value))
            elif re.fullmatch(r"--?(workdir|db-filename|s3\.config|s3\.iam\.config|dir|rank-dir)", arg):
                files.append(Path(value))
    return {k: sorted(set(v)) for k, v in ports.items()}, files


def read_agent_files(files: list[Path]) -> None:
    state_dirs = {f.parent for f in files if f.name in ("s3.json", "iam.json", "temporal.sqlite", "seaweed")}
    state_dirs |= {f.parents[2] for f in files if len(f.parents) > 2 and f.parent.name == "nodes"}
    candidates = [*files, Path.home() / ".trainguard" / "stack.json", Path("/root/.trainguard/stack.json")]
    candidates += [
        d / n
        for d in state_dirs
        for n in ("stack.json", "s3.json", "iam.json", "identity.keys", "temporal.sqlite")
    ]
    for f in candidates:
        if _is_dir(f):
            attempt(f"list {f}", lambda f=f: os.listdir(f))
            continue
        data = attempt(f"read {f}", lambda f=f: f.read_bytes()[: 1 << 20])
        if data and any(m.encode() in data for m in MARKERS):
            report["found"].append(f"credentials in {f}")


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # a directory on the way it may not enter
        return False


def other_jobs_local(victim: str, ckpt_dir: Path, snapshots: Path) -> None:
    for mine in (ckpt_dir.parent, snapshots.parent):  # .../jobs/<this job>
        jobs = mine.parent
        attempt(f"list {jobs}", lambda j=jobs: os.listdir(j))
        theirs = jobs / victim
        attempt(f"list {theirs}", lambda t=theirs: os.listdir(t))
        attempt(f"list {theirs}/ckpt", lambda t=theirs: os.listdir(t / "ckpt"))
        attempt(f"read {theirs}/ckpt/victim.pt", lambda t=theirs: (t / "ckpt" / "victim.pt").read_bytes())
        attempt(f"delete {theirs}/ckpt/victim.pt", lambda t=theirs: (t / "ckpt" / "victim.pt").unlink())


def other_jobs_s3(victim: str, ports: list[int]) -> None:
    """With no key to sign with (none was found), as an attacker would try anyway."""
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config

    victim_key = f"checkpoints/{victim}/step-0000000010/manifest.json"
    config = Config(signature_version=UNSIGNED, connect_timeout=2, read_timeout=5)
    for port in ports:
        s3 = boto3.client(
            "s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1", config=config
        )
        where = f"at :{port} with no credentials"
        attempt(
            f"list checkpoints {where}",
            lambda s3=s3: s3.list_objects_v2(Bucket=BUCKET, Prefix="checkpoints/"),
        )
        attempt(f"read {victim_key} {where}", lambda s3=s3: s3.get_object(Bucket=BUCKET, Key=victim_key))
        attempt(f"delete {victim_key} {where}", lambda s3=s3: _delete(s3, victim_key))


def _delete(s3: Any, key: str) -> None:
    r = s3.delete_objects(Bucket=BUCKET, Delete={"Objects": [{"Key": key}]})
    if r.get("Errors"):
        raise PermissionError(r["Errors"][0].get("Code"))


def temporal(ports: list[int], victim: str) -> None:
    from temporalio.client import Client

    async def connect_and_list(port: int) -> None:
        client = await asyncio.wait_for(Client.connect(f"127.0.0.1:{port}"), 5)
        await asyncio.wait_for(client.get_workflow_handle(victim).describe(), 5)

    for port in ports:
        attempt(f"Temporal at :{port}", lambda p=port: asyncio.run(connect_and_list(p)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--victim", required=True)
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ckpt-every", type=int, default=10)
    a = p.parse_args()

    ports, files = look_for_keys()
    read_agent_files(files)
    other_jobs_local(a.victim, a.ckpt_dir, Path(os.environ["TG_CKPT_DIR"]))
    other_jobs_s3(a.victim, ports["s3"])
    temporal(ports["temporal"], a.victim)
    report["ports_seen"] = ports
    print("HOSTILE " + json.dumps(report), flush=True)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    a.ckpt_dir.mkdir(parents=True, exist_ok=True)
    for step in range(1, a.steps + 1):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % a.ckpt_every == 0:
            tmp = a.ckpt_dir / "model.pt.tmp"
            torch.save({"step": step, "model": model.state_dict()}, tmp)
            tmp.rename(a.ckpt_dir / "model.pt")
            print(f"saved step {step}", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
