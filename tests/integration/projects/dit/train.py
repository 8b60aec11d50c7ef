"""Stand-in for DiT's train.py: its argument parser, then the shared tiny training."""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from standin import train

p = argparse.ArgumentParser()
p.add_argument("--data-path", type=str, required=True)
p.add_argument("--results-dir", type=str, default="results")
p.add_argument("--model", type=str, choices=["DiT-XL/2", "DiT-L/2", "DiT-B/2", "DiT-S/2"], default="DiT-XL/2")
p.add_argument("--image-size", type=int, choices=[256, 512], default=256)
p.add_argument("--num-classes", type=int, default=1000)
p.add_argument("--epochs", type=int, default=1400)
p.add_argument("--global-batch-size", type=int, default=256)
p.add_argument("--global-seed", type=int, default=0)
train("DiT", vars(p.parse_args()))
