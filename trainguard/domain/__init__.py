"""The domain: what trainguard decides and the data it decides on.

Pure code (no I/O, no clock, no randomness): workflows, the simulator and the tests run
the same decisions. Imports nothing of trainguard outside this package.
"""
