"""Stand-in for nanoGPT's train.py: its configurator (a config file to exec, then --key=value
overrides of the globals), then the shared tiny training."""

import os
import sys
from ast import literal_eval

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from standin import train

batch_size = 12
block_size = 1024
max_iters = 600000
config_keys = ["batch_size", "block_size", "max_iters"]
for arg in sys.argv[1:]:
    if "=" not in arg:
        assert not arg.startswith("--")
        with open(arg) as f:
            exec(f.read())  # the configurator's way: a config file of assignments
    else:
        key, val = arg[2:].split("=", 1)
        assert key in config_keys, key
        globals()[key] = literal_eval(val)
train("nanoGPT", {k: globals()[k] for k in config_keys})
