"""Storage codecs of ragged token keys: what is stored for a key, and the logical tensor read back.

``fp8_e4m3``: each token's vector ``x`` (``[*per_token]``, a float dtype) is stored
as ``float8_e4m3fn`` ``q = x / s`` with one float32 scale per token,
``s = max|x| / 448`` (448 is e4m3's largest finite value; an all-zero token has
``s = 1``), the recipe vLLM ``speculators`` ships for hidden states. A reader
returns ``(q.float() * s).to(logical dtype)``: the logical dtype and shape, and
zeros stay exactly zero. The checksums cover the stored bytes (``q`` and ``s``).
What the codec lost is measured at write time per token, as the relative L2 error
``|x - decode(encode(x))| / |x|`` (0 for a zero token), and recorded per shard
(max and mean) in the shard header and the manifest.
"""

from __future__ import annotations

import math

import torch

CODECS = ("fp8_e4m3",)
FP8_MAX = 448.0
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_codec_dtype(key: str, dtype: torch.dtype, codec: str | None) -> None:
    """``ValueError`` naming ``key`` when ``codec`` cannot store ``dtype``."""
    if codec is not None and dtype not in _FLOATS:
        raise ValueError(
            f"codecs[{key!r}]={codec!r} stores float keys; {key!r} is {str(dtype).removeprefix('torch.')}. "
            "Drop the codec for it, or store it as a float"
        )


def stored_dtype(dtype: torch.dtype, codec: str | None) -> torch.dtype:
    return dtype if codec is None else torch.float8_e4m3fn


def encode_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, scale, rel_err)`` of tokens ``x`` (``[T, *per_token]`` float): ``q`` float8_e4m3fn
    ``[T, *per_token]``, ``scale`` float32 ``[T]``, ``rel_err`` float32 ``[T]`` (relative L2 error)."""
    flat = x.reshape(x.shape[0], math.prod(x.shape[1:])).to(torch.float32)  # (-1 is ambiguous for 0 tokens)
    amax = flat.abs().amax(dim=1) if flat.shape[1] else torch.zeros(flat.shape[0])
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (flat / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    back = q.to(torch.float32) * scale[:, None]
    norm = flat.norm(dim=1)
    err = torch.where(norm > 0, (flat - back).norm(dim=1) / norm.clamp_min(1e-30), torch.zeros_like(norm))
    return q.reshape(x.shape), scale.contiguous(), err


def decode_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The logical tokens ``[T, *per_token]`` of ``dtype`` from stored ``q`` and ``scale`` (float32 ``[T]``)."""
    view = (-1,) + (1,) * (q.dim() - 1)
    return (q.to(torch.float32) * scale.view(view)).to(dtype)
