"""Compute self-tests whose right answer is known exactly, on any machine.

Both tests use small-integer tensors whose every intermediate sum stays below
2**24, so float32 arithmetic is exact whatever the summation order, BLAS or GPU:
the float result must equal, bit for bit, the same computation in int64. A unit
that computes wrongly (silent data corruption) cannot hide behind rounding.

- ``matmul_check``: one matmul against its int64 reference (the stop-time check).
- ``alignment_step``: one training step of a tiny two-layer model from fixed
  weights and input (forward, backward, SGD with a power-of-two step), hashed;
  every machine must produce ``ALIGNMENT_REFERENCE`` (the bit-wise alignment test).
"""

from __future__ import annotations

import hashlib

import torch

N = 128
_SEED = 1234


def _ints(gen: torch.Generator, *shape: int, lo: int = -4, hi: int = 5) -> torch.Tensor:
    return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int64)


def _digest(t: torch.Tensor) -> str:
    return "sha256:" + hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def matmul_check(corrupt: bool = False) -> tuple[bool, str]:
    """(matches the exact reference, digest of what this machine computed)."""
    gen = torch.Generator().manual_seed(_SEED)
    a, b = _ints(gen, N, N), _ints(gen, N, N)
    expected = (a @ b).to(torch.float32)
    got = (a.to(torch.float32).to(_device()) @ b.to(torch.float32).to(_device())).cpu()
    if corrupt:
        got[7, 11] += 1.0  # a drill standing on this machine: its unit computes wrongly
    return bool(torch.equal(got, expected)), _digest(got)


def _alignment(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(_SEED + 1)
    # Bounds keep every sum below 2**24: |h| <= 64, |err| <= 2052, |g2| <= 2.1e6, |g1| <= 5.3e5.
    x = _ints(gen, 16, 32, lo=-2, hi=3).to(dtype).to(device)
    w1 = _ints(gen, 32, 32, lo=-1, hi=2).to(dtype).to(device)
    w2 = _ints(gen, 32, 8, lo=-1, hi=2).to(dtype).to(device)
    target = _ints(gen, 16, 8).to(dtype).to(device)
    h = torch.relu(x @ w1)
    err = h @ w2 - target  # d(0.5 * ||y - t||^2) / dy
    g2 = h.T @ err
    g1 = x.T @ ((err @ w2.T) * (h > 0).to(dtype))
    # SGD with a power-of-two step: exact in float32 while magnitudes stay small.
    lr_shift = 2**-10
    return torch.cat([(w1 - g1 * lr_shift).reshape(-1), (w2 - g2 * lr_shift).reshape(-1)]).cpu()


def _exact_reference() -> str:
    # The same step in float64 on the CPU: every value is exactly representable in both.
    return _digest(_alignment(torch.float64, torch.device("cpu")).to(torch.float32))


def alignment_step(corrupt: bool = False) -> str:
    out = _alignment(torch.float32, _device())
    if corrupt:
        out[3] += 2**-10
    return _digest(out)


ALIGNMENT_REFERENCE = _exact_reference()
