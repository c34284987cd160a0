"""Decode fp8 tokens (float8_e4m3fn with one float32 scale per token) into a float tensor.

torch converts float8 to float32 one element at a time on the CPU, then the scale's multiply
and the cast to the logical dtype each pass over the whole batch again. Here the 256 fp8 codes
are looked up in a float32 table (numpy ``take``, vectorised), scaled in place and cast into
the destination, a cache-sized chunk of tokens at a time: one pass over memory, and the same
bits as ``(q.float() * scale[:, None]).to(dtype)``.
"""

from __future__ import annotations

import numpy as np
import torch

#: float32 value of each of the 256 float8_e4m3fn codes (NaN codes included)
_LUT = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32).numpy()
#: float32 elements decoded per chunk: the chunk stays in the core's cache between its steps
CHUNK_ELEMENTS = 1 << 16


def decode_fp8_into(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write ``q * scale`` into ``out`` and return it.

    Args:
        q: float8_e4m3fn ``[T, *per_token]`` stored tokens.
        scale: float32 ``[T]``, each token's scale.
        out: ``[T, *per_token]`` float tensor (any float dtype), contiguous; each value is the
            float32 product cast to its dtype.
    """
    t = q.shape[0]
    if t == 0 or q.numel() == 0:
        return out
    codes = q.contiguous().view(torch.uint8).numpy().reshape(t, -1)
    scales = scale.to(torch.float32).contiguous().numpy().reshape(t, 1)
    width = codes.shape[1]
    flat = out.view(t, width)
    step = max(1, CHUNK_ELEMENTS // width)
    if out.dtype == torch.float32:
        dst = flat.numpy()
        for a in range(0, t, step):
            part = dst[a : a + step]
            np.take(_LUT, codes[a : a + step], out=part)
            np.multiply(part, scales[a : a + step], out=part)
        return out
    buf = np.empty((min(step, t), width), dtype=np.float32)
    staged = torch.from_numpy(buf)
    for a in range(0, t, step):
        n = min(step, t - a)
        np.take(_LUT, codes[a : a + n], out=buf[:n])
        np.multiply(buf[:n], scales[a : a + n], out=buf[:n])
        flat[a : a + n].copy_(staged[:n])
    return out
