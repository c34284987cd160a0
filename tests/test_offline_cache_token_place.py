"""Ragged tokens read straight into their place in the batch (``token_place``), against the padded cache.

The padded cache of the same samples is the reference: a batch read, a THD collate at cp 1
and 2, and a recycled buffer must return exactly what it returns, zeros in the padding. The
planner is property-tested on real files against brute force (every token in its place, every
block verified, a damaged byte named by its row and tokens). ``hidden`` here holds 4 KiB per
token, so every token is a checksum block and a CP rank's chunks are read straight into place.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
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
)
from te_thd.offline_cache.format.ragged import block_table, row_offsets
from te_thd.offline_cache.read import token_place
from te_thd.offline_cache.read.executor import Piece, read_piece

L, H = 24, 2048
KEYS = ("input_ids", "hidden", "length")
TOKEN_KEYS = ("input_ids", "hidden")


def _compute(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    length, i = batch["length"], batch["i"]
    real = torch.arange(L).unsqueeze(0) < length.unsqueeze(1)
    g = torch.Generator().manual_seed(int(i[0]))
    return {
        "input_ids": torch.randint(1, 1000, (length.numel(), L), generator=g) * real,
        "hidden": (torch.randn(length.numel(), L, H, generator=g) * real.unsqueeze(-1)).to(
            torch.bfloat16
        ),
        "length": length,
    }


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("place")
    lengths = np.random.default_rng(3).integers(1, L + 1, 21)
    samples = [
        {"length": torch.tensor(int(n)), "i": torch.tensor(i)} for i, n in enumerate(lengths)
    ]
    for name, kw in (("padded", {}), ("ragged", {"token_keys": TOKEN_KEYS})):
        produce_cache(
            DataLoader(samples, batch_size=3),
            str(base / name),
            8,
            _compute,
            KEYS,
            progress=False,
            length_key="length",
            **kw,
        )
    return {"padded": base / "padded", "ragged": base / "ragged"}


def _ds(path: Path, **kw) -> CachedTensorDataset:
    return CachedTensorDataset(str(path), "test", 1, KEYS, **kw)


def _equal(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
            assert torch.equal(a[k], b[k]), k
        elif k != "thd_layout":
            assert a[k] == b[k], k


def test_a_recycled_batch_buffer_holds_zeros_past_each_sample(caches) -> None:
    """Long samples, dropped, then short ones read into the same recycled memory: only the
    padding is zeroed, and it is zero where the long samples were (differential: the padded cache)."""
    lengths = _ds(caches["padded"]).__getitems__(list(range(21))).tensors["length"]
    order = torch.argsort(lengths, descending=True).tolist()
    pad, rag = _ds(caches["padded"]), _ds(caches["ragged"])
    held = rag.__getitems__(order[:4])  # the longest samples, kept: the next read gets other memory
    first = rag.__getitems__(order[4:8])
    ptr = first.tensors["hidden"].data_ptr()
    del first
    gc.collect()
    blocker = torch.empty_like(held.tensors["hidden"])  # memory torch would hand out next
    for idx in (order[-4:], order[8:12][::-1]):
        got = rag.__getitems__(idx)
        assert got.tensors["hidden"].data_ptr() == ptr  # the pool's buffer, recycled
        _equal(pad.__getitems__(idx).tensors, got.tensors)
        del got
    _equal(pad.__getitems__(order[:4]).tensors, held.tensors)  # a batch held is never written
    del blocker


@pytest.mark.parametrize("cp", [1, 2])
def test_thd_collate_reads_tokens_into_place_as_the_padded_cache(caches, cp) -> None:
    """The THD loader (token keys deferred, read by the collate straight into the packed batch)
    delivers what the padded cache delivers, every CP rank, shuffled, over recycled buffers."""
    for rank in range(cp):
        outs = []
        for name in ("padded", "ragged"):
            col = CachedThdCollator(
                64, length_key="length", cp_size=cp, cp_rank=rank, pad_values={"hidden": 3}
            )
            loader = build_cached_dataloader(
                dataset=_ds(caches[name]), batch_size=5, shuffle=True, seed=4, collate_fn=col
            )
            outs.append(
                [
                    {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in b.items()}
                    for b in loader
                ]
            )
        assert len(outs[0]) == len(outs[1]) > 1
        for a, b in zip(*outs, strict=True):
            _equal(a, b)


def test_thd_token_tensors_are_recycled_only_once_dropped(caches) -> None:
    ds = _ds(caches["ragged"])
    col = CachedThdCollator(64, length_key="length")
    ds.defer_keys(col.gathered_keys(ds.disk_keys))
    held = col(ds.__getitems__([0, 1, 2]))
    out = col(ds.__getitems__([3, 4, 5]))
    assert out["hidden"].data_ptr() != held["hidden"].data_ptr()
    ptr = out["hidden"].data_ptr()
    del out
    gc.collect()
    blocker = torch.empty_like(held["hidden"])
    again = col(ds.__getitems__([3, 4, 5]))
    assert again["hidden"].data_ptr() == ptr
    pad = _ds(caches["padded"])
    _equal(CachedThdCollator(64, length_key="length")(pad.__getitems__([3, 4, 5])), again)
    _equal(CachedThdCollator(64, length_key="length")(pad.__getitems__([0, 1, 2])), held)
    del blocker


def test_collate_cached_and_small_pieces_match_the_padded_cache(caches, monkeypatch) -> None:
    """Rows cut into pieces of a block or two (verified one by one), in a worker's shared memory
    and in the main process: the same batches as the padded cache."""
    monkeypatch.setattr(token_place, "PIECE_BYTES", 9000)
    for workers in (0, 1):
        got = []
        for name in ("padded", "ragged"):
            loader = build_cached_dataloader(
                dataset=_ds(caches[name]),
                batch_size=6,
                shuffle=True,
                seed=1,
                num_workers=workers,
                collate_fn=lambda b: collate_cached(b, KEYS),
            )
            got.append([{k: v.clone() for k, v in b.items()} for b in loader])
        for a, b in zip(*got, strict=True):
            _equal(a, b)


def test_a_damaged_token_read_into_place_names_its_sample_and_tokens(caches, tmp_path) -> None:
    import shutil

    path = tmp_path / "c"
    shutil.copytree(caches["ragged"], path)
    ds = _ds(path)
    n = int(ds[9]["length"])
    shard = ds._shard_file(1)
    index = shard.tokens
    assert index is not None
    at = index.start["hidden@tokens"] + (int(index.offsets[1]) + n - 1) * H * 2 + 5
    with open(shard.path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))
    ds = _ds(path)
    with pytest.raises(
        CacheIntegrityError,
        match=rf"sample 9 \(row 1 of the shard\), key 'hidden': checksum mismatch in its tokens {n - 1}\.\.{n - 1}",
    ):
        ds.__getitems__([3, 9])
    col = CachedThdCollator(64, length_key="length")
    ds.defer_keys(col.gathered_keys(ds.disk_keys))
    with pytest.raises(CacheIntegrityError, match=r"sample 9 \(row 1 of the shard\), key 'hidden'"):
        col(ds.__getitems__([9, 2]))


# -- the planner, on real files ----------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 30), min_size=1, max_size=8),
    block=st.integers(1, 6),
    token_bytes=st.sampled_from([1, 3, 8]),
    chunk=st.sampled_from([0, 1, 7, 40, 1 << 20]),
    data=st.data(),
)
def test_plan_placed_puts_every_token_in_its_place_and_checks_every_block(
    tmp_path_factory, lengths, block, token_bytes, chunk, data
) -> None:
    offsets = row_offsets(np.asarray(lengths, dtype=np.int64))
    table = block_table(offsets, block)
    total = int(offsets[-1])
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    raw = rng.integers(0, 256, 16 + total * token_bytes, dtype=np.uint8).tobytes()
    path = str(tmp_path_factory.mktemp("f") / "t.bin")
    with open(path, "wb") as f:
        f.write(raw)
    base = 16
    blob = raw[base:]
    sums = np.array(
        [
            xxhash.xxh3_64_intdigest(
                blob[int(table.start[g]) * token_bytes : int(table.start[g + 1]) * token_bytes], g
            )
            for g in range(table.blocks)
        ],
        dtype=np.uint64,
    )
    # segments: whole blocks of rows drawn with repeats, placed back to back in a shuffled order
    segs = []
    for _ in range(data.draw(st.integers(0, 6))):
        r = data.draw(st.integers(0, len(lengths) - 1))
        n = lengths[r]
        cuts = sorted({0, n, *(min(n, block * data.draw(st.integers(0, 8))) for _ in range(2))})
        a, b = cuts[0], cuts[-1]
        if len(cuts) > 2:
            a, b = cuts[data.draw(st.integers(0, len(cuts) - 2))], cuts[-1]
        segs.append((r, a, b))
    order = rng.permutation(len(segs))
    d0, place = [], 2
    for i in order:
        r, a, b = segs[i]
        d0.append(place)
        place += b - a
    rows = np.array([segs[i][0] for i in order], dtype=np.int64)
    t0 = np.array([segs[i][1] for i in order], dtype=np.int64)
    t1 = np.array([segs[i][2] for i in order], dtype=np.int64)
    d0 = np.array(d0, dtype=np.int64)
    assert token_place.whole_blocks(table, offsets, rows, t0, t1).all()
    dst = bytearray(b"\xee" * (place + 2) * token_bytes)
    mv = memoryview(dst)

    def mismatch(row, lo, hi, want, got):
        return ValueError(f"{row} {lo} {hi}")

    fd = os.open(path, os.O_RDONLY)
    try:
        pieces: list[Piece] = []
        token_place.plan_placed(
            fd,
            path,
            base,
            table,
            offsets,
            token_bytes,
            (rows, t0, t1, d0),
            mv,
            chunk,
            pieces,
            sums,
            mismatch,
        )
        assert all(len(p.iov) <= token_place.IOV_MAX for p in pieces)
        for p in pieces:
            read_piece(p)
        want = bytearray(b"\xee" * len(dst))
        for r, a, b, d in zip(rows, t0, t1, d0, strict=True):
            s = (int(offsets[r]) + int(a)) * token_bytes
            want[int(d) * token_bytes : (int(d) + int(b - a)) * token_bytes] = blob[
                s : s + int(b - a) * token_bytes
            ]
        assert dst == want
        if not pieces:
            return
        # a damaged byte in the destination of one block: that block's row and tokens are named
        k = data.draw(st.integers(0, len(rows) - 1))
        if t1[k] == t0[k]:
            return
        tok = data.draw(st.integers(int(t0[k]), int(t1[k]) - 1))
        pieces = []
        token_place.plan_placed(
            fd,
            path,
            base,
            table,
            offsets,
            token_bytes,
            (rows, t0, t1, d0),
            mv,
            chunk,
            pieces,
            sums,
            mismatch,
        )
        victim = (int(d0[k]) + tok - int(t0[k])) * token_bytes
        for p in pieces:
            os.preadv(fd, p.iov, p.offset)
        dst[victim] ^= 0xFF
        first = tok - tok % block
        last = min(first + block, lengths[rows[k]]) - 1
        with pytest.raises(ValueError) as e:
            for p in pieces:
                p.after(*p.args)
        assert [int(x) for x in str(e.value).split()] == [int(rows[k]), first, last]
    finally:
        os.close(fd)


def test_a_new_pool_buffer_is_zero_and_says_so_a_recycled_one_does_not(monkeypatch) -> None:
    from te_thd.offline_cache.read import executor as readexec
    from te_thd.offline_cache.read.executor import DestinationBuffers

    pool = DestinationBuffers()
    assert (
        pool.get_zeroed("s", 4, (1000,), torch.bfloat16)[2] is False
    )  # small: not allocated zeroed
    t, _, zero = pool.get_zeroed("big", 4, (readexec.ZEROED_MIN_BYTES // 8,), torch.bfloat16)
    assert zero and not t.any()
    del t
    monkeypatch.setattr(readexec, "ZEROED_MIN_BYTES", 0)
    t, _, zero = pool.get_zeroed("x", 4, (1000,), torch.bfloat16)
    assert zero and not t.any()
    t.fill_(1)
    ptr = t.data_ptr()
    del t
    gc.collect()
    again, _, zero = pool.get_zeroed("x", 4, (1000,), torch.bfloat16)
    assert again.data_ptr() == ptr and not zero and again.all()  # recycled: holds what it held
    assert pool.get("y", 2, (3,), torch.float32)[0].shape == (2, 3)
    assert DestinationBuffers(shared=True).get_zeroed("x", 2, (3,), torch.float32)[2] is False


def test_a_batch_mostly_padding_gets_new_zeroed_memory_not_an_idle_buffer(
    caches, monkeypatch
) -> None:
    """A [B, L] batch whose real tokens fill less than half of it is read into a new zeroed buffer
    (its padding pages never written) instead of the key's idle buffer, dirty with the last batch,
    which is let go; the batch still equals the padded cache's (differential)."""
    from te_thd.offline_cache.read import executor as readexec

    monkeypatch.setattr(readexec, "ZEROED_MIN_BYTES", 0)  # every buffer large enough here
    pool = readexec.DestinationBuffers()
    t, _, zero = pool.get_zeroed("k", 4, (1000,), torch.bfloat16)
    t.fill_(1)
    del t
    gc.collect()
    t, _, zero = pool.get_zeroed("k", 4, (1000,), torch.bfloat16, recycle=False)
    assert zero and not t.any() and len(pool._pool[("k", torch.bfloat16, (1000,))]) == 1

    lengths = _ds(caches["padded"]).__getitems__(list(range(21))).tensors["length"]
    order = torch.argsort(lengths).tolist()
    short = order[:4]
    assert 2 * int(lengths[short].sum()) < 4 * L  # mostly padding
    pad, rag = _ds(caches["padded"]), _ds(caches["ragged"])
    first = rag.__getitems__(order[-4:])
    first.tensors["hidden"].fill_(7.0)  # the consumer dirties the batch, then drops it
    (buffers,) = rag._buffers.values()
    (dirty,) = [e for (k, *_), es in buffers._pool.items() if k == "hidden" for e in es]
    del first
    gc.collect()
    got = rag.__getitems__(short)
    _equal(pad.__getitems__(short).tensors, got.tensors)
    (entry,) = [e for (k, *_), es in buffers._pool.items() if k == "hidden" for e in es]
    assert entry is not dirty  # a new buffer, the dirty one let go


def test_a_thd_batch_mostly_padding_gets_new_zeroed_memory(caches, monkeypatch) -> None:
    """Packed THD: token keys whose padding (pad value 0) fills most of the batch's slots are read
    into new zeroed memory, not the dirty idle buffer of the last batch; the batch still equals
    the padded cache's, zeros in its padding."""
    from te_thd.offline_cache.read import executor as readexec

    monkeypatch.setattr(readexec, "ZEROED_MIN_BYTES", 0)
    ds = _ds(caches["ragged"])
    col = CachedThdCollator(64, length_key="length", rows=8)  # 8 rows of 64: mostly padding
    ds.defer_keys(col.gathered_keys(ds.disk_keys))
    out = col(ds.__getitems__([3, 4]))
    out["hidden"].fill_(7.0)  # the consumer dirties the batch, then drops it
    ((dirty,),) = [
        es for (k, *_), es in next(iter(col._pools.values()))._pool.items() if k == "hidden"
    ]
    del out
    gc.collect()
    again = col(ds.__getitems__([3, 4]))
    ((entry,),) = [
        es for (k, *_), es in next(iter(col._pools.values()))._pool.items() if k == "hidden"
    ]
    assert entry is not dirty
    pad = _ds(caches["padded"])
    _equal(CachedThdCollator(64, length_key="length", rows=8)(pad.__getitems__([3, 4])), again)
