"""The fp8 decode (``fp8.decode_fp8_into``): the same bits as torch's own fp8 -> float32,
times the scale, cast; every one of the 256 codes, chunks cut mid-batch, any float out."""

from __future__ import annotations

import pytest
import torch

from te_thd.offline_cache.format import fp8
from te_thd.offline_cache.format.codecs import Fp8E4M3


def _torch_decode(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    view = (-1,) + (1,) * (q.dim() - 1)
    return (q.to(torch.float32) * scale.view(view)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(300, 256), (7, 3, 5), (5,), (0, 4)])
def test_decode_matches_torch_bit_for_bit(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    if codes.numel() >= 256:
        codes.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)  # NaN and subnormal codes too
    q = codes.view(torch.float8_e4m3fn)
    scale = torch.exp(4 * torch.randn(shape[0], generator=g))
    want = _torch_decode(q, scale, dtype)
    got = Fp8E4M3().decode({"tokens": q, "scale": scale}, dtype)
    assert got.dtype == dtype and got.shape == q.shape
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_decode_into_a_slice_of_a_batch_cut_in_chunks(monkeypatch) -> None:
    monkeypatch.setattr(fp8, "CHUNK_ELEMENTS", 100)  # several tokens a chunk, the last one short
    x = torch.randn(53, 24) * torch.exp(torch.randn(53, 1))
    parts, _ = Fp8E4M3().encode(x.to(torch.bfloat16))
    q, s = parts["tokens"], parts["scale"]
    out = torch.full((60, 24), 7.0, dtype=torch.bfloat16)
    fp8.decode_fp8_into(q, s, out[4:57])
    assert torch.equal(out[4:57], _torch_decode(q, s, torch.bfloat16))
    assert bool((out[:4] == 7).all()) and bool((out[57:] == 7).all())
