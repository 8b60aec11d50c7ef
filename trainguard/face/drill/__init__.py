"""The fault drill suite (`trainguard drill`): one fault mix under trainguard
and under plain torchrun, scored the same way.
"""
