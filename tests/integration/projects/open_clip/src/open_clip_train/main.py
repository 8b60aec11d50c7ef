"""Stand-in for open_clip's `python -m open_clip_train.main`: its argument parser (the options its
README's single-node command gives), then the shared tiny training."""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from standin import train

p = argparse.ArgumentParser()
p.add_argument("--train-data", type=str, required=True)
p.add_argument("--train-num-samples", type=int)
p.add_argument("--dataset-type", choices=["webdataset", "csv", "synthetic", "auto"], default="auto")
p.add_argument("--batch-size", type=int, default=64)
p.add_argument("--precision", default="amp")
p.add_argument("--workers", type=int, default=4)
p.add_argument("--imagenet-val", type=str)
train("open_clip", vars(p.parse_args()))
