"""What runs on a machine besides the ranks: health probes, self-tests,
collective checks and the ports the machine hands out.
"""
