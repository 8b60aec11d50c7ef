"""Pure localization analysis: stack aggregation, fail-slow rounds, bit-wise alignment, dual-phase replay.

Everything here is a deterministic function of its inputs (no I/O, no clock, no
randomness) so the workflow, the simulator and the tests run the same code.
"""
