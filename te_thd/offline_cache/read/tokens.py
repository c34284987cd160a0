"""Reads of ragged token keys: a shard's ragged index, and a batch's ragged keys
(:class:`TokenRows`).

Ragged token keys are read as exactly the checksum blocks that hold the tokens asked for
(layout and block math: :mod:`~te_thd.offline_cache.format.ragged`). A shard's :class:`TokenIndex`
is parsed from its checked header when the reader opens it; its block sums are read and
checked against the header's digest on first use. Tokens stored as they are, in whole
blocks (whole samples; one CP rank's chunks of a key of a block per token), are read
straight into their place in the batch tensor (:mod:`~te_thd.offline_cache.read.token_place`).
Otherwise :func:`plan_stored` plans one ``preadv`` piece per run of adjacent blocks into a
staging buffer, each block hashed right after it is read by the thread that read it; the
wanted tokens are then picked out and decoded to the logical dtype. :class:`TokenRows` plans
a batch's ragged keys: whole samples padded to ``[B, L, ...]`` as the padded cache returns
them (only the padding zeroed; planned with the batch's rows and read with them), or any
tokens of them placed where the caller says (one CP rank's share, of the keys the dataset
defers).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from te_thd.offline_cache.format.integrity import (
    byte_view,
    checksum_mismatch,
    hash64,
)
from te_thd.offline_cache.format.ragged import (
    PAGE_BYTES,
    TOKENS_SUFFIX,
    BlockTable,
    StoredTensor,
    TokenReadPlan,
    plan_row_reads,
    plan_token_reads,
    token_places,
)
from te_thd.offline_cache.format.schema import advise
from te_thd.offline_cache.format.token_index import (
    TokenIndex,
    block_mismatch,
    load_block_sums,
)
from te_thd.offline_cache.read.executor import DestinationBuffers, Piece, fill_rows, new_tensor
from te_thd.offline_cache.read.planner import OpenShard
from te_thd.offline_cache.read.source import ShardSource
from te_thd.offline_cache.read.token_place import piece_bytes, plan_placed, whole_blocks


def plan_stored(
    src: ShardSource,
    f: OpenShard,
    name: str,
    rows: np.ndarray,
    pos: np.ndarray | None,
    pieces: list[Piece],
    plans: dict[tuple[int, int], TokenReadPlan] | None = None,
) -> Callable[[], torch.Tensor]:
    """Plan reading tokens ``pos`` of rows ``rows`` of stored tensor ``name`` of the token shard
    ``f`` of ``src`` (``pos`` None: every
    token of each row, in row order): appends one ``preadv`` piece per run of blocks to ``pieces``
    (each verifies its blocks right after it is read) and returns what then gives the tokens, ``[M,
    *shape]`` of the stored dtype. ``plans``: this request's plans so far, by (block size, gap):
    tensors of one token size share one."""
    index, fd = f.tokens, f.descriptor(src.prefetch, src.repair)
    assert index is not None
    s, table = index.stored[name], index.tables[name]
    shape = (table.block_tokens, PAGE_BYTES // max(1, s.token_bytes))
    plan = None if plans is None else plans.get(shape)
    if plan is None:
        plan = (
            plan_row_reads(table, index.offsets, rows, shape[1])
            if pos is None
            else plan_token_reads(table, index.offsets, rows, pos, shape[1])
        )
        if plans is not None:
            plans[shape] = plan
    buf = torch.empty((plan.tokens, *s.shape), dtype=s.dtype)
    raw = byte_view(buf)
    tb = s.token_bytes
    src.ensure(
        f,
        lambda: (
            [(index.sums_start, index.sums_bytes)]
            + [
                (
                    index.start[name] + int(table.start[g0]) * tb,
                    int(table.start[g1] - table.start[g0]) * tb,
                )
                for g0, g1 in plan.runs
            ]
        ),
    )
    sums = load_block_sums(index, fd, src.repair)[name] if src.verify else None
    cur = 0
    for g0, g1 in plan.runs:
        a, b = int(table.start[g0]), int(table.start[g1])
        view = raw[cur * tb : (cur + b - a) * tb]
        after = None if sums is None else _block_check(view, a, table, sums, f, s, src.repair)
        pieces.append(
            Piece(
                fd,
                index.start[name] + a * tb,
                [view],
                view.nbytes,
                index.path,
                after,
                (g0, range(g0, g1)),
                f,
            )
        )
        cur += b - a
    where = plan.where  # each wanted token's place in the read buffer
    return lambda: (
        buf
        if where.size == buf.shape[0] and np.array_equal(where, np.arange(where.size))
        else (buf.index_select(0, torch.from_numpy(where)))
    )


def _block_check(
    view: memoryview,
    first_token: int,
    table: BlockTable,
    sums: np.ndarray,
    f: OpenShard,
    s: StoredTensor,
    repair: str,
) -> Callable[[int, Sequence[int]], None]:
    """The check of a piece's blocks once read into ``view`` (tokens from ``first_token``) of the
    token shard ``f``."""
    index = f.tokens
    assert index is not None
    tb = s.token_bytes

    def after(_: int, blocks: Sequence[int]) -> None:
        starts = table.start[blocks[0] : blocks[-1] + 2].tolist()
        want = sums[blocks[0] : blocks[-1] + 1].tolist()
        for j, g in enumerate(blocks):
            got = hash64(
                view[(starts[j] - first_token) * tb : (starts[j + 1] - first_token) * tb], g
            )
            if got != want[j]:
                raise block_mismatch(index, s.name, g, want[j], got, f.first_sample, repair)

    return after


def place_stored(
    src: ShardSource,
    f: OpenShard,
    name: str,
    segments: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    dst: memoryview,
    pieces: list[Piece],
) -> None:
    """Plan reading whole-block ``segments`` ``(rows, t0, t1, d0)`` of stored tensor ``name`` of
    the token shard ``f`` of ``src`` straight into ``dst`` (the bytes of a contiguous ``[N,
    *per_token]`` tensor of its dtype; :func:`~te_thd.offline_cache.read.token_place.plan_placed`),
    each block verified right after it is read when ``src.verify``; the pieces are appended to
    ``pieces`` and their bytes made local."""
    index, fd = f.tokens, f.descriptor(src.prefetch, src.repair)
    assert index is not None
    s, table = index.stored[name], index.tables[name]
    src.ensure(f, lambda: [(index.sums_start, index.sums_bytes)])
    sums = load_block_sums(index, fd, src.repair)[name] if src.verify else None
    repair = src.repair
    added = plan_placed(
        fd,
        index.path,
        index.start[name],
        table,
        index.offsets,
        s.token_bytes,
        segments,
        dst,
        piece_bytes(src.verify, src.threads().threads),
        pieces,
        sums,
        # a failed block: tokens lo..hi of shard row ``row``, whose bytes hash to ``got``
        lambda row, lo, hi, want, got: checksum_mismatch(
            index.path,
            row,
            f.first_sample,
            s.key,
            want,
            got,
            tokens=(lo, hi, s.name),
            repair=repair,
        ),
        f,
    )
    src.ensure(f, lambda: [(p.offset, p.nbytes) for p in pieces[len(pieces) - added :]])


def decode(index: TokenIndex, key: str, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Ragged key ``key`` from its stored tensors' tokens (``{stored name: [M, ...]}``): logical
    dtype."""
    codec = index.layout.codec(key)
    if codec is None:
        return parts[key + TOKENS_SUFFIX]
    roles = {index.stored[n].role: parts[n] for n in stored_names(index, key)}
    return codec.decode(roles, index.logical[key].dtype)


def stored_names(index: TokenIndex, key: str) -> tuple[str, ...]:
    """The stored tensors of ragged key ``key`` (its tokens, then a codec's other parts)."""
    return (
        key + TOKENS_SUFFIX,
        *(n for n, s in index.stored.items() if s.key == key and s.role != "tokens"),
    )


class TokenRows:
    """A batch's ragged keys, not yet read: ``B`` samples at ``places`` (``(shards, rows)``, int64
    ``[B]`` each).

    ``lengths``: int64 ``[B]`` (from the shard offsets, no data read); ``specs``: each of the ragged
    ``keys``' logical ``[L, ...]`` spec. Reads go through ``source`` (the dataset's shards).
    """

    def __init__(
        self,
        source: ShardSource,
        places: tuple[np.ndarray, np.ndarray],
        keys: Sequence[str],
    ) -> None:
        self._source = source
        self.shards, self.rows = places
        lengths = np.empty(self.rows.size, dtype=np.int64)
        for shard in np.unique(self.shards).tolist():
            at = self.shards == shard
            lengths[at] = self._index(shard).lengths[self.rows[at]]
        self.lengths = lengths
        assert source.schema is not None  # set by the first shard opened, at the latest
        self.specs = {k: source.schema[k] for k in keys}

    def plan(
        self, keys: Sequence[str], sample: np.ndarray, pos: np.ndarray | None, pieces: list[Piece]
    ) -> Callable[[], dict[str, torch.Tensor]]:
        """Plan reading tokens ``pos`` of batch samples ``sample`` (int64 ``[M]``, each ``pos <
        length``; ``pos`` None: every token of each sample, in order) of each of ``keys``: appends
        the ``preadv`` pieces to ``pieces`` (each verifies its blocks right after it is read, by the
        thread that read it) and returns what, once they are read, gives ``{key: [M, *per_token]}``,
        logical dtype."""
        sample = np.asarray(sample, dtype=np.int64)
        if pos is not None:
            pos = np.asarray(pos, dtype=np.int64)
            self._check(keys, sample, pos)
        shard_of = self.shards[sample]
        shards = np.unique(shard_of).tolist()
        first = len(pieces)
        planned: list[
            tuple[np.ndarray | None, TokenIndex, dict[str, Callable[[], torch.Tensor]]]
        ] = []
        for shard in shards:
            at = None if len(shards) == 1 else np.flatnonzero(shard_of == shard)
            f = self._source.shard(shard)
            index = f.tokens
            assert index is not None
            rows, p = (
                (self.rows[sample], pos)
                if at is None
                else (self.rows[sample[at]], None if pos is None else pos[at])
            )
            plans: dict[tuple[int, int], TokenReadPlan] = {}
            parts = {
                n: plan_stored(self._source, f, n, rows, p, pieces, plans)
                for k in keys
                for n in stored_names(index, k)
            }
            planned.append((at, index, parts))
        if (
            len(pieces) - first > 1
        ):  # scattered reads (a CP rank's chunks) queue as one deep run of requests
            for piece in pieces[first:]:
                advise(piece.fd, "willneed", piece.offset, piece.nbytes)
        if (
            pos is None and len(planned) > 1
        ):  # whole samples of several shards: place each shard's tokens
            lens = self.lengths[sample]
            skip = np.cumsum(lens) - lens
            planned = [
                (token_places(skip[at], lens[at]), index, parts) for at, index, parts in planned
            ]
        size = sample.size if pos is not None else int(self.lengths[sample].sum())

        def result() -> dict[str, torch.Tensor]:
            out: dict[str, torch.Tensor] = {}
            for key in keys:
                if len(planned) == 1:
                    _, index, parts = planned[0]
                    out[key] = decode(index, key, {n: parts[n]() for n in stored_names(index, key)})
                    continue
                spec = self.specs[key]
                out[key] = dst = torch.empty((size, *spec.shape[1:]), dtype=spec.dtype)
                for at, index, parts in planned:
                    dst[torch.from_numpy(at)] = decode(
                        index, key, {n: parts[n]() for n in stored_names(index, key)}
                    )
            return out

        return result

    def plan_padded(
        self,
        keys: Sequence[str],
        pieces: list[Piece],
        buffers: DestinationBuffers | None = None,
    ) -> Callable[[], dict[str, torch.Tensor]]:
        """Plan reading each of ``keys`` of every sample whole; once read, the result is ``{key: [B,
        L, *per_token]}`` zero-padded (what the padded cache returns). The tensors come from
        ``buffers`` (a pool that hands a buffer out again only once the consumer dropped it) when
        given, else fresh. Only the padding is zeroed, here; the tokens are read straight into
        place (:meth:`place`)."""
        b = self.lengths.size
        sample = np.arange(b, dtype=np.int64)
        out: dict[str, torch.Tensor] = {}
        flat: dict[str, torch.Tensor] = {}
        width = 0
        real = int(self.lengths.sum())
        for key in keys:
            spec = self.specs[key]
            # mostly padding: a new zeroed buffer, whose padding pages are never touched
            mostly_pad = 2 * real < b * spec.shape[0]
            t, zero = (
                buffers.get_zeroed(key, b, spec.shape, spec.dtype, recycle=not mostly_pad)[::2]
                if buffers is not None
                else (new_tensor((b, *spec.shape), spec.dtype), False)
            )
            width = spec.shape[0]
            out[key], flat[key] = t, t.view(b * width, *spec.shape[1:])
            if not zero:  # (a new buffer is zero already)
                fill_rows(
                    flat[key],
                    (sample * width + self.lengths).tolist(),
                    ((sample + 1) * width).tolist(),
                )
        placed = self.place(keys, sample, None, sample * width, flat, pieces)
        return lambda: (placed(), out)[1]

    def place(
        self,
        keys: Sequence[str],
        sample: np.ndarray,
        pos: np.ndarray | None,
        dst: np.ndarray,
        out: Mapping[str, torch.Tensor],
        pieces: list[Piece],
    ) -> Callable[[], dict[str, torch.Tensor]]:
        """Plan reading tokens ``pos`` of batch samples ``sample`` (int64 ``[M]``, each ``pos <
        length``) of each of ``keys`` into rows ``dst`` (int64 ``[M]``) of ``out[key]`` (``[N,
        *per_token]``, contiguous, the key's logical dtype). ``pos`` None: every token of each
        sample, sample ``i``'s first to row ``dst[i]`` and the rest after it.

        Tokens that are whole checksum blocks of a key stored as it is are read straight into place
        (:func:`place_stored`); the rest (a codec's, a block cut by the request) are read by
        :meth:`plan` and copied into place by the returned step, which gives ``{key: out[key]}``.
        """
        sample = np.asarray(sample, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        if pos is None:
            seg, t0, t1, d0 = sample, np.zeros_like(sample), self.lengths[sample], dst
            cut = np.arange(sample.size + 1)
        else:
            pos = np.asarray(pos, dtype=np.int64)
            self._check(keys, sample, pos)
            brk = np.flatnonzero((np.diff(sample) != 0) | (np.diff(pos) != 1) | (np.diff(dst) != 1))
            cut = np.concatenate(([0], brk + 1, [sample.size])) if sample.size else np.zeros(1, int)
            seg, t0, d0 = sample[cut[:-1]], pos[cut[:-1]], dst[cut[:-1]]
            t1 = pos[cut[1:] - 1] + 1 if sample.size else t0
        shard_of = self.shards[seg]
        shards = np.unique(shard_of).tolist()
        later: list[tuple[str, Callable[[], dict[str, torch.Tensor]], np.ndarray]] = []
        first = len(pieces)
        for key in keys:
            staged = np.zeros(seg.size, dtype=bool)  # segments read through a staging buffer
            raw = byte_view(out[key])
            for shard in shards:
                at = np.flatnonzero(shard_of == shard) if len(shards) > 1 else np.arange(seg.size)
                f = self._source.shard(shard)
                index = f.tokens
                assert index is not None
                if index.layout.codec(key) is not None:
                    staged[:] = True
                    break
                name, rows = key + TOKENS_SUFFIX, self.rows[seg[at]]
                ok = whole_blocks(index.tables[name], index.offsets, rows, t0[at], t1[at])
                staged[at[~ok]] = True
                parts = (rows[ok], t0[at][ok], t1[at][ok], d0[at][ok])
                place_stored(self._source, f, name, parts, raw, pieces)
            if not staged.any():
                continue
            if pos is None:
                s = sample[staged]
                lens = self.lengths[s]
                rows_at = token_places(dst[staged], lens)
                later.append((key, self.plan([key], s, None, pieces), rows_at))
            else:
                tok = np.repeat(staged, np.diff(cut))
                later.append((key, self.plan([key], sample[tok], pos[tok], pieces), dst[tok]))
        if len(pieces) - first > 1:  # from cold storage: every piece's pages requested at once
            for piece in pieces[first:]:
                advise(piece.fd, "willneed", piece.offset, piece.nbytes)

        def finish() -> dict[str, torch.Tensor]:
            for key, tokens, rows_at in later:
                out[key].index_copy_(0, torch.from_numpy(rows_at), tokens()[key])
            return {k: out[k] for k in keys}

        return finish

    def _check(self, keys: Sequence[str], sample: np.ndarray, pos: np.ndarray) -> None:
        if np.any(pos < 0) or np.any(pos >= self.lengths[sample]):
            raise IndexError(
                f"token positions past their samples' lengths requested from keys {list(keys)}"
            )

    def place_many(
        self,
        keys: Sequence[str],
        sample: np.ndarray,
        pos: np.ndarray | None,
        dst: np.ndarray,
        out: Mapping[str, torch.Tensor],
    ) -> None:
        """:meth:`place`, read now."""
        self._read(lambda pieces: self.place(keys, sample, pos, dst, out, pieces))

    def gather_many(
        self, keys: Sequence[str], sample: np.ndarray, pos: np.ndarray
    ) -> dict[str, torch.Tensor]:
        """:meth:`plan`'s tokens, read now."""
        return self._read(lambda pieces: self.plan(keys, sample, pos, pieces))

    def padded_many(self, keys: Sequence[str]) -> dict[str, torch.Tensor]:
        """:meth:`plan_padded`'s whole samples, read now."""
        return self._read(lambda pieces: self.plan_padded(keys, pieces))

    def _read(
        self, plan: Callable[[list[Piece]], Callable[[], dict[str, torch.Tensor]]]
    ) -> dict[str, torch.Tensor]:
        """Plan with ``plan(pieces)`` and read on the dataset's read threads; a shard of an s3://
        cache whose local copy fails a check is fetched again, once."""
        if not self.shards.size:
            return {}

        def once(_: Any) -> dict[str, torch.Tensor]:
            pieces: list[Piece] = []
            result = plan(pieces)
            self._source.run(pieces)
            return result()

        return self._source.retry(once, None)

    def _index(self, shard: int) -> TokenIndex:
        """The ragged index of token shard ``shard`` (opened by the source)."""
        index = self._source.shard(shard).tokens
        assert index is not None
        return index
