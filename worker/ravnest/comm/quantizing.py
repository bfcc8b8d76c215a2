"""int8 ring pieces (`training.compression: int8`): float32 values in blocks of BLOCK elements,
each block as one float32 scale (its largest magnitude / 127) and a signed byte per element, the
value over the scale rounded to the nearest integer. A piece of n elements weighs
n + 4 * ceil(n / BLOCK) bytes, ~3.9x less than float32 (~1.97x less than bfloat16).

Rounding to the nearest is biased block by block; the ring corrects that by error feedback (what
a node's rounding lost goes into its next round, train/allreducing.py). A block holding a value
that is not finite decodes to NaN (its scale is not finite), so a diverged run shows as one.
"""

from __future__ import annotations

import torch

BLOCK = 256
"""Elements per scale."""

LEVELS = 127.0


def blocks(n: int) -> int:
    """Scales in a piece of `n` elements."""
    return -(-n // BLOCK)


def quantize(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """Write the int8 `codes` (x's size) and float32 `scales` (`blocks(x.numel())`) of the 1-d
    float32 `x`."""
    n = x.numel()
    full = n - n % BLOCK
    parts = [(x[:full].view(-1, BLOCK), codes[:full].view(-1, BLOCK), scales[:full // BLOCK])]
    if full < n:
        parts.append((x[full:].view(1, -1), codes[full:].view(1, -1), scales[full // BLOCK:]))
    with torch.no_grad():
        for xs, cs, ss in parts:
            torch.amax(xs.abs(), dim=1, out=ss)
            ss.div_(LEVELS)
            inverse = torch.where(ss > 0, ss.reciprocal(), torch.zeros_like(ss))
            scaled = (xs * inverse[:, None]).round_().clamp_(-LEVELS, LEVELS)
            cs.copy_(scaled)  # (NaN where the scale is not finite: its block decodes to NaN)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write the float32 values of `codes` and `scales` into `out` (codes' size); `out`."""
    n = codes.numel()
    full = n - n % BLOCK
    with torch.no_grad():
        torch.mul(codes[:full].view(-1, BLOCK), scales[:full // BLOCK, None],
                  out=out[:full].view(-1, BLOCK))
        if full < n:
            torch.mul(codes[full:], scales[full // BLOCK:], out=out[full:])
    return out
