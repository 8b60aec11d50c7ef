"""A job spec read from its YAML file (validation is ``trainguard.domain.spec``'s)."""

from __future__ import annotations

from pathlib import Path

from trainguard.domain.spec import MAX_SPEC_FILE_BYTES, JobSpec, SpecError, parse_spec_yaml


def load_spec(path: str | Path) -> JobSpec:
    """Load and validate a YAML spec file (at most 1 MiB of UTF-8); SpecError names the field."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            # One byte past the limit tells a file too large without reading all of it.
            raw = f.read(MAX_SPEC_FILE_BYTES + 1)
    except OSError as exc:
        raise SpecError("spec", f"cannot read {p}: {exc.strerror}") from None
    return parse_spec_yaml(raw, str(p))
