"""Stand-in for llama3's example_chat_completion.py: its main(ckpt_dir, tokenizer_path, ...)
as fire reads it from the command line, then the shared tiny training."""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from standin import train

p = argparse.ArgumentParser()
p.add_argument("--ckpt_dir", required=True)
p.add_argument("--tokenizer_path", required=True)
p.add_argument("--temperature", type=float, default=0.6)
p.add_argument("--top_p", type=float, default=0.9)
p.add_argument("--max_seq_len", type=int, default=512)
p.add_argument("--max_batch_size", type=int, default=4)
train("llama3", vars(p.parse_args()))
