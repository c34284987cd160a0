"""The ``topk_index:<V>`` codec: integer index keys stored in the narrowest width that holds the vocabulary.

The pure encode / decode functions are property-tested at the width boundaries
(65,536 and 131,072 tokens); the codec's caches are tested differentially against
the same samples stored padded and ragged without it: every read path must return
identical tensors (dtype, shape, values).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from te_thd.offline_cache import (
    CachedTensorDataset,
    CachedThdCollator,
    CacheIntegrityError,
    build_cached_dataloader,
    collate_cached,
    produce_cache,
    verify_cache,
)
from te_thd.offline_cache.format.codecs import TopkIndex, check_codec
from te_thd.offline_cache.format.integrity import read_shard_header
from te_thd.offline_cache.tools.verify import cache_info

L, K = 20, 5  # K not a multiple of 8: the last byte of packed high bits is partly padding
KEYS = ("ids", "next_id", "logprobs", "length")
TOKEN_KEYS = ("ids", "next_id", "logprobs")
BOUNDARIES = (1, 2, 255, 65535, 65536, 65537, 131071, 131072, 131073, 2**31)


# -- the pure functions --------------------------------------------------------------------


def _indices(
    t: int, shape: tuple[int, ...], vocab: int, dtype: torch.dtype, seed: int
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (t, *shape), generator=g, dtype=torch.int64)
    flat = x.view(-1)
    if flat.numel():  # both ends of the range
        flat[0], flat[-1] = vocab - 1, 0
    return x.to(dtype)


@settings(max_examples=150, deadline=None)
@given(
    vocab=st.sampled_from(BOUNDARIES),
    t=st.integers(0, 12),
    shape=st.lists(st.integers(0, 9), max_size=2).map(tuple),
    dtype=st.sampled_from([torch.int32, torch.int64]),
    seed=st.integers(0, 2**16),
)
def test_index_codec_round_trip_is_exact(
    vocab: int, t: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int
) -> None:
    x = _indices(t, shape, vocab, dtype, seed)
    codec = check_codec("ids", f"topk_index:{vocab}")
    assert isinstance(codec, TopkIndex) and codec.vocab == vocab
    assert codec.out_of_range(x) is None
    parts, err = codec.encode(x)
    assert err is None  # lossless
    layout = codec.stored_parts(dtype, shape)
    assert [(r, parts[r].dtype, tuple(parts[r].shape)) for r, _, _ in layout] == [
        (r, d, (t, *s)) for r, d, s in layout
    ]
    back = codec.decode(parts, dtype)
    assert back.dtype == dtype and back.shape == x.shape and torch.equal(back, x)
    n = math.prod(shape)
    bits = codec.bits
    assert bits == (16 if vocab <= 65536 else 17 if vocab <= 131072 else 32)
    per_token = {16: 2 * n, 17: 2 * n + -(-n // 8), 32: 4 * n}[bits]
    assert sum(p.numel() * p.element_size() for p in parts.values()) == t * per_token
    if t:  # any tokens of the stored parts decode to those tokens (a CP rank's partial read)
        pick = torch.from_numpy(np.random.default_rng(seed).integers(0, t, 7))
        sub = codec.decode({r: p.index_select(0, pick) for r, p in parts.items()}, dtype)
        assert torch.equal(sub, x.index_select(0, pick))


@settings(max_examples=100, deadline=None)
@given(
    vocab=st.sampled_from(BOUNDARIES),
    t=st.integers(1, 12),
    n=st.integers(1, 9),
    where=st.integers(0, 10**6),
    negative=st.booleans(),
    offset=st.integers(0, 2**20),
    dtype=st.sampled_from([torch.int32, torch.int64]),
)
def test_indices_outside_the_vocabulary_are_found(
    vocab, t, n, where, negative, offset, dtype
) -> None:
    x = _indices(t, (n,), vocab, dtype, where)
    bad = -1 - offset if negative else vocab + offset
    if not negative and bad > torch.iinfo(dtype).max:
        bad = -1  # an int32 key cannot hold an index past int32's range; a negative one stands in
    pos = where % (t * n)
    x.view(-1)[pos] = bad
    assert TopkIndex(vocab).out_of_range(x) == (pos // n, bad)


def test_stored_parts_per_width() -> None:
    assert TopkIndex(65536).stored_parts(torch.int64, (8,)) == [("tokens", torch.int16, (8,))]
    assert TopkIndex(65537).stored_parts(torch.int64, (8,)) == [
        ("tokens", torch.int16, (8,)),
        ("high", torch.uint8, (1,)),
    ]
    assert TopkIndex(131072).stored_parts(torch.int32, (9,))[1] == ("high", torch.uint8, (2,))
    assert TopkIndex(131072).stored_parts(torch.int64, ()) == [
        ("tokens", torch.int16, ()),
        ("high", torch.uint8, (1,)),
    ]
    assert TopkIndex(131073).stored_parts(torch.int64, (8,)) == [("tokens", torch.int32, (8,))]


# -- caches with the codec read back what caches without it do -------------------------------


def _samples(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [{"length": torch.tensor(int(torch.randint(0, L + 1, (1,), generator=g))), "i": torch.tensor(i)}
            for i in range(n)]  # fmt: skip


def _compute(vocab: int, bad: tuple[int, int] | None = None):
    def compute(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        length, idx = batch["length"], batch["i"]
        real = torch.arange(L).unsqueeze(0) < length.unsqueeze(1)
        ids = torch.stack(
            [_indices(L, (K,), vocab, torch.int64, int(i)) for i in idx]
        ) * real.unsqueeze(-1)
        next_id = ids[..., 0].to(torch.int32)
        if bad is not None and bad[0] in idx.tolist():
            ids[idx.tolist().index(bad[0]), 0, 1] = bad[1]
        return {
            "ids": ids,
            "next_id": next_id,
            "logprobs": -ids.float() * real.unsqueeze(-1),
            "length": length,
        }

    return compute


def _produce(
    out: Path, vocab: int, bad: tuple[int, int] | None = None, shard_size: int = 8, **kw
) -> dict:
    return produce_cache(DataLoader(_samples(23), batch_size=3), str(out), shard_size, _compute(vocab, bad), KEYS,
                         progress=False, length_key="length", **kw)  # fmt: skip


def _codecs(vocab: int) -> dict[str, str]:
    return {"ids": f"topk_index:{vocab}", "next_id": f"topk_index:{vocab}"}


@pytest.fixture(scope="module", params=[65536, 131072, 131073], ids=lambda v: f"vocab{v}")
def caches(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Path]]:
    vocab, base = request.param, tmp_path_factory.mktemp(f"index{request.param}")
    _produce(base / "padded", vocab)
    _produce(base / "ragged", vocab, token_keys=TOKEN_KEYS)
    _produce(base / "codec", vocab, token_keys=TOKEN_KEYS, codecs=_codecs(vocab))
    return vocab, {k: base / k for k in ("padded", "ragged", "codec")}


def _ds(path: Path) -> CachedTensorDataset:
    return CachedTensorDataset(str(path), "test", 1, KEYS)


def _same(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert v.dtype == b[k].dtype and v.shape == b[k].shape and torch.equal(v, b[k]), k
        elif k != "thd_layout":
            assert v == b[k], k


def test_every_read_path_returns_the_tensors_written(caches) -> None:
    vocab, c = caches
    ref, rag, enc = _ds(c["padded"]), _ds(c["ragged"]), _ds(c["codec"])
    assert ref[0]["ids"].dtype == torch.int64 and ref[0]["next_id"].dtype == torch.int32
    assert int(max(int(ref[i]["ids"].max()) for i in range(len(ref)))) == vocab - 1
    for i in [*range(len(ref)), -1]:
        _same(ref[i], enc[i])
        _same(rag[i], enc[i])
    rng = np.random.default_rng(0)
    for indices in ([0, 1, 2], rng.permutation(23).tolist(), [22, 4, 4, 9]):
        _same(ref.__getitems__(indices).tensors, enc.__getitems__(indices).tensors)
        _same(ref.start_read(indices).result().tensors, enc.start_read(indices).result().tensors)
    for cp_rank in range(2):  # a CP rank reads only its share of each sample's tokens
        idx = rng.permutation(23)[:9].tolist()
        col = CachedThdCollator(
            64, input_key="next_id", length_key="length", cp_size=2, cp_rank=cp_rank
        )
        _same(col(rag.__getitems__(idx)), col(enc.__getitems__(idx)))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_loader_returns_the_padded_cache_batches(caches, num_workers) -> None:
    _, c = caches

    def loader(path: Path):
        return build_cached_dataloader(dataset=_ds(path), batch_size=5, shuffle=False,
                                       collate_fn=lambda f: collate_cached(f, KEYS), num_workers=num_workers)  # fmt: skip

    batches = list(zip(loader(c["padded"]), loader(c["codec"]), strict=True))
    assert len(batches) == 5
    for a, b in batches:
        _same(a, b)


def test_the_codec_is_recorded_and_stores_fewer_bytes(caches) -> None:
    vocab, c = caches
    raw = json.loads((c["codec"] / "manifest.json").read_text())
    assert raw["token_layout"]["codecs"] == _codecs(vocab)
    assert "fidelity" not in raw["shards"][0]  # lossless: nothing lost to record
    entries = read_shard_header(str(c["codec"] / "shard-000000.safetensors")).entries
    plain = read_shard_header(str(c["ragged"] / "shard-000000.safetensors")).entries
    stored = sorted(n for n in entries if n.startswith("ids@"))
    assert stored == (
        ["ids@tokens"]
        if vocab <= 65536
        else ["ids@high", "ids@tokens"]
        if vocab <= 131072
        else ["ids@tokens"]
    )
    nbytes = sum(entries[n].end - entries[n].start for n in stored)
    tokens = plain["ids@tokens"].shape[0]
    bits = TopkIndex(vocab).bits
    assert nbytes == tokens * {16: 2 * K, 17: 2 * K + 1, 32: 4 * K}[bits]
    info = cache_info(str(c["codec"]))
    form = {16: "", 17: ": 16 + 1 packed high bit", 32: ": int32"}[bits]
    assert (
        info["storage"]["ids"]
        == f"ragged, topk_index:{vocab}, {bits} bits per index{form} (logical int64)"
    )
    assert info["fidelity"] == {}
    report = verify_cache(str(c["codec"]), deep=True)
    assert report["checksums_verified"] and report["lengths_verified"]


# -- damage and bad input ----------------------------------------------------------------------


@pytest.mark.parametrize("target", ["ids@high", "ids@tokens"])
def test_a_flipped_byte_in_a_stored_part_is_caught(tmp_path: Path, target: str) -> None:
    _produce(tmp_path / "c", 131072, token_keys=TOKEN_KEYS, codecs=_codecs(131072))
    shard = tmp_path / "c" / "shard-000001.safetensors"
    e = read_shard_header(str(shard)).entries[target]
    with open(shard, "r+b") as f:
        f.seek(e.start + (e.end - e.start) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(
        CacheIntegrityError, match=rf"shard-000001.*key 'ids'.*checksum mismatch.*\({target};"
    ):
        _ = _ds(tmp_path / "c").__getitems__(list(range(8, 16))).tensors
    with pytest.raises(CacheIntegrityError, match="shard-000001"):
        verify_cache(str(tmp_path / "c"), deep=True)


@pytest.mark.parametrize(
    ("vocab", "value", "fix"),
    [
        (65536, -1, "an index is a vocabulary id: store a real id in its place"),
        (65536, 65536, "give the codec the vocabulary size of the model that produced it, codecs={'ids': 'topk_index:<vocabulary size>'}"),
        (131073, 2**40, "give the codec the vocabulary size"),
    ],
)  # fmt: skip
def test_an_index_outside_the_vocabulary_is_refused_naming_key_value_and_fix(
    tmp_path: Path, vocab, value, fix
) -> None:
    with pytest.raises(ValueError) as e:
        _produce(
            tmp_path / "c", vocab, bad=(12, value), token_keys=TOKEN_KEYS, codecs=_codecs(vocab)
        )
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"sample 12 (row 4 of the shard): key 'ids' holds index {value}, outside [0, {vocab}) of "
                          f"codecs['ids']='topk_index:{vocab}': {fix}")  # fmt: skip
    assert msg.endswith("; nothing of this shard was kept")
    assert not (tmp_path / "c" / "manifest.json").exists()
    assert (tmp_path / "c" / "shard-000000.safetensors").exists()  # the shards before it are kept
    assert not (tmp_path / "c" / "shard-000001.safetensors").exists()


@pytest.mark.parametrize(
    ("codecs", "match"),
    [
        ({"ids": "topk_index"}, r"codecs\['ids'\]='topk_index' is not a storage codec \(the vocabulary size must be "
                                r"an int in \[1, 2147483648\], e.g. 'topk_index:151936'\); use 'fp8_e4m3' or "
                                r"'topk_index:<vocabulary size>'"),
        ({"ids": "topk_index:0"}, r"'topk_index:0' is not a storage codec \(the vocabulary size must be"),
        ({"ids": "topk_index:2147483649"}, r"is not a storage codec \(the vocabulary size must be"),
        ({"ids": "topk_index:1e5"}, r"is not a storage codec \(the vocabulary size must be"),
        ({"logprobs": "topk_index:100"}, r"codecs\['logprobs'\]='topk_index:100' stores int32 or int64 index keys; "
                                         r"'logprobs' is float32. Drop the codec for it, or store it as int64"),
        ({"ids": "fp8_e4m3"}, r"codecs\['ids'\]='fp8_e4m3' stores float keys; 'ids' is int64"),
    ],
)  # fmt: skip
def test_bad_index_codec_arguments(tmp_path: Path, codecs, match) -> None:
    with pytest.raises(ValueError, match=match):
        _produce(tmp_path / "c", 100, token_keys=TOKEN_KEYS, codecs=codecs)
    assert not (tmp_path / "c" / "manifest.json").exists()


def test_cache_info_cli_shows_the_codec(caches) -> None:
    vocab, c = caches
    cli = Path(sys.executable).with_name("te-thd")
    out = subprocess.run(
        [str(cli), "cache", "info", str(c["codec"])], capture_output=True, text=True, check=True
    ).stdout
    assert f"topk_index:{vocab}, {TopkIndex(vocab).bits} bits per index" in out
