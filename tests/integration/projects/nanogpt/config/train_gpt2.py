# Stand-in for nanoGPT's config/train_gpt2.py: assignments the configurator execs.
batch_size = 12
block_size = 1024
max_iters = 600000
