"""A script's own checkpoints (``--checkpoint-dir``) in S3: layout and the rules that make one whole.

Each top-level entry of the checkpoint directory is one checkpoint stream: a file (``ckpt.pt``,
usually rewritten at every save, or ``step-20.pt``) or a ``torch.distributed.checkpoint``
directory (``.metadata`` written last, by the coordinator, once every rank's parts are written).

    <job prefix>/script-ckpt/<name>/v-<order>/<name>          a file's content
    <job prefix>/script-ckpt/<name>/parts/<relative path>     a DCP directory's parts, from every machine
    <job prefix>/script-ckpt/<name>/v-<order>/manifest.json   written last, once every file is stored

``order`` is the writing machine's modification time (ns) of the file, or of the DCP ``.metadata``:
newer saves have larger orders. A checkpoint exists only when its manifest exists and every file
it lists is stored with the recorded size. The job is told of every one stored
(``ScriptCheckpointRef``) and chooses what the next attempt restores
(``trainguard.domain.restore_point``): exactly those (:func:`to_restore`); a job that chose none
(it knows none yet, or a controller of the previous release) gets, for every name, the newest one.
Limitation: a DCP directory rewritten in place under the same name shares its parts' keys with
the previous save; scripts that save DCP into a new directory per step (the usual way) are exact.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict

from trainguard.domain.messages import ScriptCheckpointRef

SUBDIR = "script-ckpt"
MANIFEST = "manifest.json"
DCP_METADATA = ".metadata"


class ScriptFile(BaseModel):
    model_config = ConfigDict(frozen=True)

    path: str  # relative to the checkpoint directory
    key: str
    size: int


class ScriptManifest(BaseModel):
    model_config = ConfigDict(frozen=True)

    job: str
    name: str
    kind: str  # "file" | "dcp"
    order: int
    # The attempt whose agent wrote this manifest: what a fenced store checks the write against.
    attempt: int
    node: str
    files: list[ScriptFile]
    created_at: str
    # The newest step the writing machine's ranks had all reported when it was stored (None: none yet).
    step: int | None = None


def ref_of(m: ScriptManifest, uri: str) -> ScriptCheckpointRef:
    """What the job is told of a stored checkpoint (``uri``: its manifest's)."""
    return ScriptCheckpointRef(
        name=m.name,
        kind=m.kind,
        order=m.order,
        attempt=m.attempt,
        step=m.step,
        size=sum(f.size for f in m.files),
        created_at=datetime.fromisoformat(m.created_at),
        uri=uri,
    )


def prefix(job_prefix: str) -> str:
    return f"{job_prefix}/{SUBDIR}"


def version_dir(sprefix: str, name: str, order: int) -> str:
    # Zero-padded so lexical order is save order in listings.
    return f"{sprefix}/{name}/v-{order:020d}"


def file_key(sprefix: str, name: str, order: int) -> str:
    return f"{version_dir(sprefix, name, order)}/{name}"


def part_key(sprefix: str, name: str, rel: str) -> str:
    return f"{sprefix}/{name}/parts/{rel}"


def manifest_key(sprefix: str, name: str, order: int) -> str:
    return f"{version_dir(sprefix, name, order)}/{MANIFEST}"


def is_manifest_key(key: str) -> bool:
    return key.endswith("/" + MANIFEST) and "/v-" in key


def complete(m: ScriptManifest, sizes: dict[str, int]) -> bool:
    """Every file the manifest lists is stored whole."""
    return bool(m.files) and all(sizes.get(f.key) == f.size for f in m.files)


def newest_per_name(manifests: list[ScriptManifest], sizes: dict[str, int]) -> list[ScriptManifest]:
    """For every name, its newest complete checkpoint (what a machine restores)."""
    best: dict[str, ScriptManifest] = {}
    for m in manifests:
        if complete(m, sizes) and (m.name not in best or m.order > best[m.name].order):
            best[m.name] = m
    return sorted(best.values(), key=lambda m: m.name)


def to_prune(manifests: list[ScriptManifest], sizes: dict[str, int], keep: int) -> list[ScriptManifest]:
    """Complete checkpoints beyond the newest ``keep``, over every name (a script that names each
    save by its step keeps ``keep`` of them; one that rewrites ``ckpt.pt``, ``keep`` versions)."""
    done = sorted((m for m in manifests if complete(m, sizes)), key=lambda m: m.order, reverse=True)
    return done[keep:]


def to_restore(
    manifests: list[ScriptManifest], sizes: dict[str, int], chosen: list[ScriptCheckpointRef]
) -> tuple[list[ScriptManifest], list[str]]:
    """What a machine restores: the checkpoints the job ``chosen`` (none chosen: the newest
    complete one of every name), never an incomplete one; a chosen one missing or incomplete in
    S3 gives way to the newest complete one of its name, with a warning (the second value)."""
    newest = {m.name: m for m in newest_per_name(manifests, sizes)}
    if not chosen:
        return sorted(newest.values(), key=lambda m: m.name), []
    found = {(m.name, m.order): m for m in manifests if complete(m, sizes)}
    out: list[ScriptManifest] = []
    warnings: list[str] = []
    for ref in sorted(chosen, key=lambda r: r.name):
        m = found.get((ref.name, ref.order))
        if m is None:
            m = newest.get(ref.name)
            instead = f"order {m.order}" if m is not None else "nothing"
            warnings.append(f"script checkpoint {ref.name} (order {ref.order}) incomplete: {instead} instead")
        if m is not None:
            out.append(m)
    return out, warnings
