"""The fault drill suite from a source checkout, without progress bars:

    python bench/drill.py [--json] [--faults crash,hang] [--seed S] [--gap-steps N] [--code-dir DIR]

The same drill as ``trainguard drill``; the suite is ``trainguard/face/drill/suite.py``.
"""

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from trainguard.domain.spec import SpecError  # noqa: E402
from trainguard.face.cli import exit_now  # noqa: E402
from trainguard.face.drill.mix import DEFAULT_GAP_STEPS, STANDARD_MIX, parse_faults, schedule  # noqa: E402
from trainguard.face.drill.suite import default_code_dir, example_spec, render, run_drill  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", default=",".join(STANDARD_MIX))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gap-steps", type=int, default=DEFAULT_GAP_STEPS)
    ap.add_argument("--code-dir", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    code_dir = args.code_dir or default_code_dir()
    try:
        names = parse_faults(args.faults)
        schedule(names, args.gap_steps, args.seed)
        example_spec(code_dir, "gpt-drill")
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        exit_now(2)
    doc = run_drill(names, args.seed, args.gap_steps, code_dir=code_dir)
    print(json.dumps(doc) if args.json else render(doc))
    exit_now(0 if doc["systems"]["trainguard"]["completed"] else 1)


if __name__ == "__main__":
    main()
