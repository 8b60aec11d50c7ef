"""Stand-in for llama-recipes' examples/finetuning.py: fire's keyword arguments (`--name value`,
a bare `--flag`, dotted `--fsdp_config.pure_bf16` into a sub-config), then the shared training."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from standin import train

kwargs: dict[str, object] = {}
argv = sys.argv[1:]
i = 0
while i < len(argv):
    key = argv[i].removeprefix("--")
    if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
        kwargs[key], i = argv[i + 1], i + 2
    else:
        kwargs[key], i = True, i + 1
train("llama-recipes", kwargs)
