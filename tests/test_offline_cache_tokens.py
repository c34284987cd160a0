"""Ragged token keys (``produce_cache(token_keys=...)``) and the fp8 codec, against the padded cache.

The padded cache of the same samples is the reference: every read path of a ragged
cache must return exactly what it returns (lossless keys bit for bit, zeros in the
padding), and an fp8-encoded key must come back in its logical dtype and shape
within e4m3's error. The layout math is property-tested against brute force.
"""

from __future__ import annotations

import json
import os
import pickle
import re
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
    ManifestError,
    build_cached_dataloader,
    collate_cached,
    produce_cache,
    read_manifest,
    verify_cache,
)
from te_thd.offline_cache.format.codecs import Fp8E4M3
from te_thd.offline_cache.format.ragged import (
    block_table,
    plan_row_reads,
    plan_token_reads,
    row_offsets,
)
from te_thd.offline_cache.read.tokens import TokenRows
from te_thd.offline_cache.tools.cli import format_info
from te_thd.offline_cache.tools.verify import cache_info

L, H = 24, 16
KEYS = ("input_ids", "hidden", "logprobs", "length", "mask")
TOKEN_KEYS = ("input_ids", "hidden", "logprobs")


def _samples(n: int, seed: int = 0, min_len: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(min_len, L + 1, (1,), generator=g))
        ids = torch.zeros(L, dtype=torch.int64)
        ids[:length] = torch.randint(1, 1000, (length,), generator=g)
        out.append({"input_ids": ids, "length": torch.tensor(length)})
    return out


def _compute(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    ids, length = batch["input_ids"], batch["length"]
    real = torch.arange(L).unsqueeze(0) < length.unsqueeze(1)
    # per sample, so a resumed run (other batches) computes the same values
    hidden = torch.stack(
        [torch.randn(L, H, generator=torch.Generator().manual_seed(int(r.sum()))) for r in ids]
    )
    hidden = hidden * real.unsqueeze(-1)
    return {
        "input_ids": ids,
        "hidden": hidden.to(torch.bfloat16),
        "logprobs": (-hidden.abs().sum(-1)).float() * real,
        "length": length,
        "mask": real.to(torch.uint8),
    }


def _produce(out: Path, samples, shard_size: int = 8, **kw) -> dict:
    return produce_cache(DataLoader(samples, batch_size=3), str(out), shard_size, _compute, KEYS,
                         progress=False, length_key="length", **kw)  # fmt: skip


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("tokens")
    samples = _samples(29)
    _produce(base / "padded", samples)
    _produce(base / "ragged", samples, token_keys=TOKEN_KEYS)
    _produce(base / "fp8", samples, token_keys=TOKEN_KEYS, codecs={"hidden": "fp8_e4m3"})
    return {k: base / k for k in ("padded", "ragged", "fp8")}


def _ds(path: Path, keys=KEYS, **kw) -> CachedTensorDataset:
    return CachedTensorDataset(str(path), "test", 1, keys, **kw)


def _assert_same(a: dict, b: dict, lossy: tuple[str, ...] = ()) -> None:
    assert set(a) == set(b)
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
            if k in lossy:
                torch.testing.assert_close(
                    a[k].float(),
                    b[k].float(),
                    rtol=0.07,
                    atol=0.07 * float(a[k].float().abs().max()),
                )
                assert (
                    torch.equal(a[k] == 0, b[k] == 0) or k == "hidden"
                )  # zeros in the padding stay zero
            else:
                assert torch.equal(a[k], b[k]), k
        elif k != "thd_layout":
            assert a[k] == b[k], k


# -- the layout math ---------------------------------------------------------------------

#: rows of 0-40 tokens, checksum blocks of 1-9 tokens, and draws from them
_TABLES = {
    "lengths": st.lists(st.integers(0, 40), min_size=1, max_size=12),
    "block": st.integers(1, 9),
    "data": st.data(),
}


@settings(max_examples=200, deadline=None)
@given(**_TABLES)
def test_plan_token_reads_fetches_exactly_the_blocks_holding_the_tokens(
    lengths, block, data
) -> None:
    lengths = np.asarray(lengths, dtype=np.int64)
    offsets = row_offsets(lengths)
    table = block_table(offsets, block)
    # the blocks tile the tensor, row by row, at most `block` tokens each, never across rows
    assert table.start[0] == 0 and table.start[-1] == offsets[-1]
    assert np.all(np.diff(table.start) >= 1) and np.all(np.diff(table.start) <= block)
    for r in range(lengths.size):
        g0, g1 = int(table.row_first[r]), int(table.row_first[r + 1])
        assert g1 - g0 == -(-lengths[r] // block)
        if g1 > g0:
            assert table.start[g0] == offsets[r] and table.start[g1] == offsets[r + 1]
    real = [(r, p) for r in range(lengths.size) for p in range(lengths[r])]
    if not real:
        return
    picks = data.draw(st.lists(st.sampled_from(real), min_size=1, max_size=30))
    max_gap = data.draw(st.integers(0, 12))
    rows = np.asarray([r for r, _ in picks], dtype=np.int64)
    pos = np.asarray([p for _, p in picks], dtype=np.int64)
    plan = plan_token_reads(table, offsets, rows, pos, max_gap)
    # brute force: the blocks of the picked tokens, each read once, run by run into one buffer
    wanted_blocks = sorted({int(table.row_first[r]) + p // block for r, p in picks})
    got_blocks = [g for a, b in plan.runs for g in range(a, b)]
    assert set(wanted_blocks) <= set(got_blocks) and len(got_blocks) == len(set(got_blocks))
    assert plan.runs[0][0] == wanted_blocks[0] and plan.runs[-1][1] == wanted_blocks[-1] + 1
    for (
        a,
        b,
    ) in plan.runs:  # a run starts and ends with a wanted block; its gaps hold <= max_gap tokens
        assert a in wanted_blocks and b - 1 in wanted_blocks
        inner = [g for g in wanted_blocks if a <= g < b]
        assert all(
            table.start[y] - table.start[x + 1] <= max_gap
            for x, y in zip(inner, inner[1:], strict=False)
        )
    for (_, b1), (a2, _) in zip(
        plan.runs, plan.runs[1:], strict=False
    ):  # ascending, gaps above max_gap
        assert b1 < a2 and table.start[a2] - table.start[b1] > max_gap
    if max_gap == 0:
        assert got_blocks == wanted_blocks
    buffer = np.concatenate([np.arange(table.start[a], table.start[b]) for a, b in plan.runs])
    assert plan.tokens == buffer.size
    assert np.array_equal(buffer[plan.where], offsets[rows] + pos)


@settings(max_examples=300, deadline=None)
@given(**_TABLES)
def test_plan_row_reads_is_plan_token_reads_of_whole_rows(lengths, block, data) -> None:
    """Differential: planning whole rows per row gives the per-token planner's runs, buffer size and
    token places, for any rows (repeated, unordered, empty ones among them) and any gap."""
    lengths = np.asarray(lengths, dtype=np.int64)
    offsets = row_offsets(lengths)
    table = block_table(offsets, block)
    rows = np.asarray(
        data.draw(st.lists(st.integers(0, lengths.size - 1), min_size=1, max_size=10)),
        dtype=np.int64,
    )
    if data.draw(st.booleans()):
        rows = np.unique(rows)  # the sorted case the planner takes without a search
    max_gap = data.draw(st.integers(0, 12))
    got = plan_row_reads(table, offsets, rows, max_gap)
    sample = np.repeat(rows, lengths[rows])
    pos = np.concatenate([np.arange(n) for n in lengths[rows]]).astype(np.int64)
    want = plan_token_reads(table, offsets, sample, pos, max_gap)
    assert got.runs == want.runs and got.tokens == want.tokens
    assert np.array_equal(got.where, want.where)


@settings(max_examples=50, deadline=None)
@given(
    t=st.integers(0, 20),
    d=st.integers(1, 40),
    scale=st.floats(1e-3, 1e4),
    seed=st.integers(0, 2**16),
)
def test_fp8_codec_round_trip(t: int, d: int, scale: float, seed: int) -> None:
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(seed)) * scale
    if t:
        x[0] = 0  # an all-zero token stays exactly zero
    parts, err = Fp8E4M3().encode(x.to(torch.bfloat16))
    q, s = parts["tokens"], parts["scale"]
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (t,)
    back = Fp8E4M3().decode(parts, torch.bfloat16)
    assert back.dtype == torch.bfloat16 and back.shape == x.shape
    if t:
        assert torch.equal(back[0], torch.zeros(d, dtype=torch.bfloat16)) and err[0] == 0
    rel = (back.float() - x.to(torch.bfloat16).float()).norm(dim=1) / x.to(
        torch.bfloat16
    ).float().norm(dim=1).clamp_min(1e-30)
    assert torch.all(err <= 0.07) and torch.allclose(rel, err, atol=1e-2)


# -- every read path returns what the padded cache returns ---------------------------------


def test_manifest_records_the_layout_and_the_reference_tag(caches) -> None:
    raw = json.loads((caches["ragged"] / "manifest.json").read_text())
    assert raw["format_version"] == "1+tokens"
    assert raw["token_layout"] == {"keys": list(TOKEN_KEYS), "codecs": {}}
    m = read_manifest(str(caches["ragged"]), "test", 1)
    assert (
        m["format_version"] == 1
        and m["schema"] == json.loads((caches["padded"] / "manifest.json").read_text())["schema"]
    )


@pytest.mark.parametrize("name", ["ragged", "fp8"])
def test_getitem_and_getitems_match_the_padded_cache(caches, name) -> None:
    lossy = ("hidden",) if name == "fp8" else ()
    pad, rag = _ds(caches["padded"]), _ds(caches[name])
    for i in [*range(len(pad)), -1, -29]:
        _assert_same(pad[i], rag[i], lossy)
    rng = np.random.default_rng(0)
    for indices in ([0, 1, 2], [28, 3, 17, 3, 9, 0, 8], rng.permutation(29).tolist(), [5]):
        a, b = pad.__getitems__(indices), rag.__getitems__(indices)
        _assert_same(a.tensors, b.tensors, lossy)
        _assert_same(
            pad.start_read(indices).result().tensors,
            rag.start_read(indices).result().tensors,
            lossy,
        )


def test_a_batch_reaches_every_key_the_same_way_whatever_its_layout(caches, monkeypatch) -> None:
    """``keys`` / ``sample_spec`` / ``padded`` / ``gather`` of a ragged batch whose token keys are
    deferred match the padded cache's (the reference); a deferred key is read only by those calls,
    and once read padded it is gathered from that copy, not read again."""
    idx = [28, 3, 17, 9, 0, 8]
    ds = _ds(caches["ragged"])
    assert ds.defer_keys(("length", *TOKEN_KEYS)) == TOKEN_KEYS  # only ragged keys are deferred
    pad, rag = _ds(caches["padded"]).__getitems__(idx), ds.__getitems__(idx)
    assert set(pad.keys) == set(rag.keys) == set(KEYS) and len(rag.keys) == len(KEYS)
    assert not set(rag.tensors) & set(TOKEN_KEYS)  # nothing of a deferred key was read
    assert all(pad.sample_spec(k) == rag.sample_spec(k) for k in KEYS)
    lengths = pad.padded(["length"])["length"].numpy()
    sample = np.repeat(np.arange(len(idx)), lengths)
    pos = np.concatenate([np.arange(n) for n in lengths])
    _assert_same(pad.gather(TOKEN_KEYS, sample, pos), rag.gather(TOKEN_KEYS, sample, pos))
    _assert_same(pad.padded(["hidden"]), rag.padded(["hidden"]))
    asked: list[str] = []
    real = TokenRows.gather_many
    monkeypatch.setattr(
        TokenRows,
        "gather_many",
        lambda self, keys, *a: (asked.extend(keys), real(self, keys, *a))[1],
    )
    _assert_same(pad.gather(TOKEN_KEYS, sample, pos), rag.gather(TOKEN_KEYS, sample, pos))
    assert sorted(asked) == ["input_ids", "logprobs"]  # hidden was read padded above
    _assert_same(
        pad.tensors, collate_cached(ds.__getitems__(idx), KEYS)
    )  # reads the deferred keys whole
    _assert_same(pad.tensors, rag.padded(rag.keys))
    _assert_same(
        pad.tensors, pickle.loads(pickle.dumps(ds.__getitems__(idx))).tensors
    )  # pickling reads them first


def test_a_batch_read_returns_every_key_read_and_verified(caches, monkeypatch) -> None:
    """Without deferred keys the batch read reads the ragged keys with the rows: the batch's
    ``tensors`` hold every key and nothing reads afterwards (no I/O behind an attribute)."""
    monkeypatch.setattr(
        TokenRows, "gather_many", lambda *a: pytest.fail("a read after the batch read")
    )
    monkeypatch.setattr(
        TokenRows, "padded_many", lambda *a: pytest.fail("a read after the batch read")
    )
    idx = [28, 3, 17, 9, 0, 8]
    pad, ds = _ds(caches["padded"]), _ds(caches["ragged"])
    for rag in (ds.__getitems__(idx), ds.start_read(idx).result()):
        assert rag.deferred is None and set(rag.tensors) == set(KEYS)
        _assert_same(pad.__getitems__(idx).tensors, rag.tensors)
        CachedThdCollator(64, length_key="length", cp_size=2, cp_rank=1)(rag)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_loader_with_collate_cached_matches_the_padded_cache(caches, num_workers) -> None:
    def loader(path):
        return build_cached_dataloader(dataset=_ds(path), batch_size=4, shuffle=False,
                                       collate_fn=lambda f: collate_cached(f, KEYS), num_workers=num_workers)  # fmt: skip

    batches = list(zip(loader(caches["padded"]), loader(caches["ragged"]), strict=True))
    assert len(batches) == 8
    for a, b in batches:
        _assert_same(a, b)


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("name", ["ragged", "fp8"])
def test_thd_collator_packs_straight_from_ragged_rows_on_every_rank(caches, cp_size, name) -> None:
    lossy = ("hidden",) if name == "fp8" else ()
    pad, rag = _ds(caches["padded"]), _ds(caches[name])
    idx = [4, 11, 0, 27, 19, 8, 13]
    kws = [
        {"length_key": "length"},
        {"mask_key": "mask", "rows": 4},
        {"length_key": "length", "label_key": "input_ids"},
        # explicit token_keys, a subset of keys, and a ragged key left per sample
        {
            "keys": ("input_ids", "hidden", "length", "logprobs"),
            "token_keys": ("hidden",),
            "length_key": "length",
        },
    ]
    for rank in range(cp_size):
        for kw in kws:
            col = CachedThdCollator(64, cp_size=cp_size, cp_rank=rank, **kw)
            want = col(pad.__getitems__(idx))
            for deferred in (
                (),
                col.gathered_keys(rag.disk_keys),
            ):  # read with the batch, or by the collate
                rag.defer_keys(deferred)
                _assert_same(want, col(rag.__getitems__(idx)), lossy)


def test_thd_collator_in_loader_workers(caches) -> None:
    col = CachedThdCollator(96, length_key="length", cp_size=2, cp_rank=1)

    def loader(path):
        return build_cached_dataloader(
            dataset=_ds(path), batch_size=5, shuffle=False, collate_fn=col, num_workers=2
        )

    for a, b in zip(loader(caches["padded"]), loader(caches["ragged"]), strict=True):
        _assert_same(a, b)


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc/self/io")
def test_a_cp_rank_reads_only_its_share_of_the_ragged_tokens(tmp_path: Path) -> None:
    """Bytes the read system calls return (rchar): a rank at cp=C reads about 1/C of the token data."""
    global L, H
    old = L, H
    L, H = 1024, 256  # big rows: 512-byte tokens, 8 tokens per checksum block
    try:
        samples = _samples(8, seed=3, min_len=600)
        _produce(tmp_path / "c", samples, shard_size=8, token_keys=("hidden", "logprobs"))
        ds = _ds(tmp_path / "c", ("input_ids", "hidden", "logprobs", "length"))
        ds[0]  # opens the shard: header, and the block sums on first verified read
        idx = list(range(8))

        def fetched(cp: int, rank: int, defer: bool = True) -> int:
            col = CachedThdCollator(8 * L, length_key="length", cp_size=cp, cp_rank=rank)
            ds.defer_keys(col.gathered_keys(ds.disk_keys) if defer else ())
            batch = ds.__getitems__(idx)
            before = _rchar()
            col(batch)
            return _rchar() - before

        assert (
            fetched(2, 0, defer=False) < 4096
        )  # the batch read read every key: the collate reads nothing
        # (but /proc/self/io itself)

        whole = fetched(1, 0)
        token_bytes = sum(int(s["length"]) for s in samples) * (H * 2 + 4)
        assert token_bytes <= whole < token_bytes * 1.05
        for cp in (2, 4):
            for rank in range(cp):
                assert fetched(cp, rank) <= 1.2 * whole / cp, (cp, rank)
    finally:
        L, H = old


# -- integrity ---------------------------------------------------------------------------


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def _entry(path: Path, name: str) -> tuple[int, int]:
    from te_thd.offline_cache.format.integrity import read_shard_header

    e = read_shard_header(str(path)).entries[name]
    return e.start, e.end


@pytest.mark.parametrize("target", ["hidden@tokens", "input_ids@tokens", "__te_thd_block_sums__"])
def test_a_flipped_byte_in_a_ragged_tensor_is_caught_on_every_path(
    tmp_path: Path, target: str
) -> None:
    _produce(tmp_path / "c", _samples(16), token_keys=TOKEN_KEYS)
    shard = tmp_path / "c" / "shard-000001.safetensors"
    start, end = _entry(shard, target)
    _flip(shard, start + (end - start) // 2)
    ds = _ds(tmp_path / "c")
    reads = [
        lambda: [ds[i] for i in range(8, 16)],
        lambda: ds.__getitems__(list(range(16))).tensors,
        lambda: CachedThdCollator(512, length_key="length")(ds.__getitems__(list(range(8, 16)))),
        lambda: CachedThdCollator(512, length_key="length", cp_size=2)(
            ds.__getitems__(list(range(8, 16))) if ds.defer_keys(TOKEN_KEYS) else None
        ),
    ]
    for read in reads:
        with pytest.raises(CacheIntegrityError, match="shard-000001") as exc:
            read()
        ds = _ds(tmp_path / "c")  # a fresh reader: the first open must catch it too
    assert "checksum" in str(exc.value) and "te-thd cache" in str(exc.value)
    with pytest.raises(CacheIntegrityError, match="shard-000001"):
        verify_cache(str(tmp_path / "c"), deep=True)
    assert _ds(tmp_path / "c")[0]["hidden"].shape == (L, H)  # the undamaged shard still reads


@pytest.mark.parametrize("where", [0.1, 0.5, 0.9])
def test_verify_deep_and_a_read_name_the_same_damaged_block(tmp_path: Path, where: float) -> None:
    """verify --deep hashes a memory map of the shard, not through the read path: both
    name the same sample, key and tokens of a flipped byte, and a sound cache passes both."""
    _produce(tmp_path / "c", _samples(16), token_keys=TOKEN_KEYS)
    assert verify_cache(str(tmp_path / "c"), deep=True)["num_samples"] == 16
    shard = tmp_path / "c" / "shard-000001.safetensors"
    start, end = _entry(shard, "hidden@tokens")
    _flip(shard, start + int((end - start) * where))
    with pytest.raises(CacheIntegrityError) as read:
        _ds(tmp_path / "c").__getitems__(list(range(8, 16)))
    with pytest.raises(CacheIntegrityError) as deep:
        verify_cache(str(tmp_path / "c"), deep=True)
    named = re.compile(r"sample \d+ \(row \d+ of the shard\), key 'hidden': checksum mismatch in its tokens \d+\.\.\d+")
    assert named.search(str(read.value)), str(read.value)
    assert named.search(str(read.value)).group() == named.search(str(deep.value)).group()


def test_a_token_shard_truncated_under_an_open_reader_names_it_and_the_repair(
    tmp_path: Path,
) -> None:
    """The shard is opened and read once (header, token index and block sums checked and kept),
    then loses its ragged tail: the next ragged reads (a padded batch, one CP rank's tokens) fail
    with the reader's one "cannot be read" error, naming the shard, the short read and the repair
    command."""
    _produce(tmp_path / "c", _samples(16), token_keys=TOKEN_KEYS)
    shard = tmp_path / "c" / "shard-000001.safetensors"
    ds = _ds(tmp_path / "c")
    assert ds.__getitems__([8]).tensors["hidden"].shape == (1, L, H)
    ds.defer_keys(TOKEN_KEYS)
    batch = ds.__getitems__(list(range(8, 16)))  # its ragged keys are read when asked for
    start, _ = _entry(shard, "hidden@tokens")
    os.truncate(shard, start + 8)
    want = r"shard \S*shard-000001\.safetensors cannot be read \(.*file ended at byte \d+ while reading .*\)\. Repair: `te-thd cache repair "
    with pytest.raises(CacheIntegrityError, match=want) as exc:
        batch.padded(["hidden"])
    assert exc.value.path == str(shard)
    with pytest.raises(CacheIntegrityError, match=want):
        CachedThdCollator(512, length_key="length", cp_size=2, cp_rank=1)(
            ds.__getitems__(list(range(8, 16)))
        )
    ds.defer_keys(())
    with pytest.raises(CacheIntegrityError, match=want):
        ds.__getitems__(list(range(8, 16)))


def test_a_flipped_byte_in_the_token_offsets_is_caught_on_open(tmp_path: Path) -> None:
    _produce(tmp_path / "c", _samples(8), token_keys=TOKEN_KEYS)
    shard = tmp_path / "c" / "shard-000000.safetensors"
    text = shard.read_bytes()
    at = text.index(b'offsets\\":\\"') + 16
    _flip(shard, at)
    with pytest.raises(CacheIntegrityError, match="shard-000000"):
        _ds(tmp_path / "c")[0]


def test_the_reference_reader_refuses_a_ragged_cache(caches) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "perf"))
    from harness import reference_offline_cache

    ref = reference_offline_cache()
    if ref is None:
        pytest.skip(
            "the reference implementation (perf/reference-requirements.txt) is not installed"
        )
    with pytest.raises(ValueError, match=r"format_version=1\+tokens, expected 1"):
        ref.read_manifest(str(caches["ragged"]), cache_name="test", format_version=1)
    with pytest.raises(ValueError, match="format_version"):
        ref.CachedTensorDataset(
            cache_dir=str(caches["fp8"]), cache_name="test", format_version=1, disk_keys=KEYS
        )
    # the padded cache of the same samples still reads there
    ds = ref.CachedTensorDataset(
        cache_dir=str(caches["padded"]), cache_name="test", format_version=1, disk_keys=KEYS
    )
    assert torch.equal(ds[3]["hidden"], _ds(caches["ragged"])[3]["hidden"])


def test_a_manifest_with_a_layout_but_no_tag_is_refused(tmp_path: Path) -> None:
    from te_thd.offline_cache.record.manifest import manifest_checksum

    _produce(tmp_path / "c", _samples(4), token_keys=TOKEN_KEYS)
    path = tmp_path / "c" / "manifest.json"
    m = json.loads(path.read_text())
    m["format_version"] = 1
    m.pop("manifest_checksum")
    m["manifest_checksum"] = manifest_checksum(m)
    path.write_text(json.dumps(m))
    with pytest.raises(ManifestError, match="token_layout"):
        _ds(tmp_path / "c")


# -- the producer ------------------------------------------------------------------------


def test_ragged_shards_store_only_the_real_tokens(caches) -> None:
    def sizes(name):
        return sum(p.stat().st_size for p in caches[name].glob("shard-*.safetensors"))

    lengths = [int(s["length"]) for s in _samples(29)]
    per_token = H * 2 + 4 + 8  # hidden bf16, logprobs f32, input_ids i64
    assert sizes("padded") >= 29 * L * per_token
    real = sum(lengths) * per_token
    # real bytes, plus the per-sample keys, the block sums and the headers
    assert sizes("ragged") < real + 29 * (8 + 24) + 4 * 4096

    def stored(name, tensor):
        a, b = _entry(caches[name] / "shard-000000.safetensors", tensor)
        return b - a

    # fp8: 1 byte per value plus a 4-byte scale per token, instead of bf16's 2 bytes per value
    fp8 = stored("fp8", "hidden@tokens") + stored("fp8", "hidden@scale")
    assert fp8 * (2 * H) == stored("ragged", "hidden@tokens") * (H + 4)


def test_resume_after_a_crash_writes_the_same_bytes(tmp_path: Path) -> None:
    samples = _samples(20)
    _produce(tmp_path / "full", samples, token_keys=TOKEN_KEYS, codecs={"hidden": "fp8_e4m3"})
    calls = {"n": 0}

    def dies(batch):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("killed")
        return _compute(batch)

    with pytest.raises(RuntimeError, match="killed"):
        produce_cache(DataLoader(samples, batch_size=3), str(tmp_path / "r"), 8, dies, KEYS, progress=False,
                      length_key="length", token_keys=TOKEN_KEYS, codecs={"hidden": "fp8_e4m3"})  # fmt: skip
    assert (tmp_path / "r" / "shard-000000.safetensors").exists() and not (
        tmp_path / "r" / "manifest.json"
    ).exists()
    _produce(tmp_path / "r", samples, token_keys=TOKEN_KEYS, codecs={"hidden": "fp8_e4m3"})

    def files(d):
        return {p.name: p.read_bytes() for p in sorted(d.iterdir())}

    assert files(tmp_path / "r") == files(tmp_path / "full")
    with pytest.raises(ValueError, match="token_layout"):  # another layout over the same directory
        _produce(tmp_path / "r", samples, token_keys=("hidden",))


def test_zero_length_samples_read_back_as_zeros(tmp_path: Path) -> None:
    samples = _samples(6, min_len=0)
    samples[2]["input_ids"][:] = 0
    samples[2]["length"] = torch.tensor(0)
    _produce(tmp_path / "p", samples)
    _produce(tmp_path / "r", samples, token_keys=TOKEN_KEYS)
    a, b = _ds(tmp_path / "p"), _ds(tmp_path / "r")
    _assert_same(a.__getitems__(list(range(6))).tensors, b.__getitems__(list(range(6))).tensors)
    assert torch.count_nonzero(b[2]["hidden"]) == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"token_keys": ("nope",)}, r"token_keys \['nope'\] are not stored keys"),
        ({"token_keys": "hidden"}, r"token_keys='hidden' must be a tuple of key names"),
        (
            {"token_keys": ("hidden",), "codecs": {"logprobs": "fp8_e4m3"}},
            "add 'logprobs' to token_keys",
        ),
        (
            {"token_keys": ("hidden",), "codecs": {"hidden": "int4"}},
            r"codecs\['hidden'\]='int4' is not a storage codec",
        ),
        ({"token_keys": ("input_ids",), "codecs": {"input_ids": "fp8_e4m3"}}, "stores float keys"),
        ({"token_keys": ("length",)}, "a token key is \\[n, L, ...\\]"),
    ],
)
def test_bad_token_arguments(tmp_path: Path, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        _produce(tmp_path / "c", _samples(4), **kwargs)
    assert not (tmp_path / "c" / "manifest.json").exists()


def test_token_keys_need_lengths(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs each sample's length"):
        produce_cache(DataLoader(_samples(4), batch_size=2), str(tmp_path / "c"), 4, _compute, ("hidden", "length"),
                      progress=False, token_keys=("hidden",))  # fmt: skip


# -- what users see ----------------------------------------------------------------------


def test_cache_info_shows_the_storage_and_the_fidelity(caches) -> None:
    info = cache_info(str(caches["fp8"]))
    assert (
        info["storage"]["hidden"].startswith("ragged, fp8_e4m3")
        and info["storage"]["length"] == "rows"
    )
    assert (
        0
        < info["fidelity"]["hidden"]["mean_rel_l2"]
        <= info["fidelity"]["hidden"]["max_rel_l2"]
        < 0.07
    )
    text = format_info(info)
    assert (
        "ragged, fp8_e4m3 + float32 scale per token" in text
        and "relative L2 error per token: max" in text
    )
    cli = Path(sys.executable).with_name("te-thd")
    out = subprocess.run(
        [str(cli), "cache", "info", str(caches["fp8"])], capture_output=True, text=True, check=True
    ).stdout
    assert "fp8_e4m3" in out and "input_ids" in out and "ragged" in out
    report = verify_cache(str(caches["fp8"]), deep=True)
    assert report["checksums_verified"] and report["lengths_verified"]


def test_a_length_outside_the_row_names_its_global_sample(tmp_path: Path) -> None:
    """A ``compute_batch`` whose length key gives sample 5 more tokens than a row holds is refused
    at that sample's shard, naming sample 5 (row 1 of shard 1, shards of 4), not its row alone."""
    import _s3_producer_script as P

    from te_thd.offline_cache import produce_cache

    def compute(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = P.compute_batch(batch)
        if 5 in batch["index"].tolist():
            out["length"] = out["length"].clone()
            out["length"][batch["index"].tolist().index(5)] = P.L + 3
        return out

    samples = [{**s, "index": torch.tensor(i)} for i, s in enumerate(P.dataset(12))]
    with pytest.raises(ValueError) as e:
        produce_cache(DataLoader(samples, batch_size=2), str(tmp_path / "c"), 4, compute, P.KEYS,
                      progress=False, length_key="length", token_keys=P.TOKEN_KEYS)  # fmt: skip
    assert f"sample 5 (row 1 of the shard) has length {P.L + 3} by" in str(e.value)
    assert f"outside [0, L={P.L}]" in str(e.value) and ".tmp" not in str(e.value)


def test_a_collator_without_lengths_is_refused_on_a_ragged_cache_before_any_read(caches) -> None:
    """A ragged key holds only each sample's real tokens: a collator packing full rows of L would
    read past them (an IndexError deep in the read) or pack the zeros behind them as tokens."""
    rag, col = _ds(caches["ragged"]), CachedThdCollator(64)
    want = (
        r"^CachedThdCollator\(length_key=None\) packs every sample as its full row of L tokens, but the "
        r"test cache at .*/ragged stores \['input_ids', 'hidden', 'logprobs'\] ragged \(each sample's "
        r"real tokens only\); pass CachedThdCollator\(\.\.\., length_key='length'\)$"
    )
    with pytest.raises(ValueError, match=want):
        build_cached_dataloader(rag, 4, False, col)
    with pytest.raises(
        ValueError, match=r"length_key='length'\) and add 'length' to the dataset's disk_keys$"
    ):
        build_cached_dataloader(_ds(caches["ragged"], ("input_ids", "hidden")), 4, False, col)
    # a DataLoader of its own: refused at the first batch, whether the ragged keys come read or deferred
    for deferred in ((), ("hidden",)):
        rag.defer_keys(deferred)
        with pytest.raises(
            ValueError, match=r"the cache these samples come from stores .* pass length_key="
        ):
            next(iter(DataLoader(rag, batch_size=4, collate_fn=col)))
    assert pickle.loads(pickle.dumps(rag.__getitems__([0, 1]))).ragged == TOKEN_KEYS
    # the padded cache's rows are what they hold: full rows are its samples, as before
    pad = _ds(caches["padded"])
    build_cached_dataloader(pad, 4, False, col)
    assert col(pad.__getitems__([0, 1]))["num_samples"] == 2
    # with the lengths the ragged cache packs as the padded one
    col = CachedThdCollator(64, length_key="length")
    _assert_same(col(pad.__getitems__([3, 5])), col(rag.__getitems__([3, 5])))
