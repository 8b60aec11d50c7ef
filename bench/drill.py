"""The fault drill suite from a source checkout: ``python bench/drill.py [--json] [--faults ...]``.

The same as ``trainguard drill``; the suite lives in ``trainguard/face/drill/suite.py``.
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from trainguard.face.drill.suite import main  # noqa: E402

if __name__ == "__main__":
    main()
