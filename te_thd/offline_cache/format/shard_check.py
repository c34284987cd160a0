"""One shard file checked completely: its header against the cache's schema and row count, every
row of every key and every block of every ragged tensor against the checksums the shard carries,
and the whole file against the manifest's record. The producer's resume and ``te-thd cache
verify --deep`` call it on a local file. It hashes a memory map of the file, sharing with the read
path only the parse of a ragged shard's index and its block sums, so the two check each other.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from te_thd.offline_cache.format.integrity import (
    HASH_NAME,
    ShardHeader,
    byte_row_sums,
    check_shard_header,
    checksum_mismatch,
    shard_checksum,
)
from te_thd.offline_cache.format.schema import CacheIntegrityError, CacheSchema
from te_thd.offline_cache.format.token_index import check_token_blocks

#: The shard checksum manifests of older te_thd versions record: CRC-32 of the whole file.
LEGACY_CHECKSUM = "crc32"


def _file_crc32(path: str) -> str:
    """``"crc32:<8 hex>"`` of the whole file at ``path`` (streamed; never holds the file in
    memory)."""
    crc = 0
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{LEGACY_CHECKSUM}:{crc & 0xFFFFFFFF:08x}"


@dataclass(frozen=True)
class ShardCheck:
    """What :func:`verify_shard_file` found: the header, the file's size and its checksum (the
    manifest's spelling)."""

    header: ShardHeader
    bytes: int
    checksum: str


def _check_row_sums(path: str, header: ShardHeader, first_sample: int | None) -> None:
    """Hash every row of every key in the file (every block of a ragged tensor) and compare with the
    sums its header carries. ``first_sample``: the global index of the shard's row 0 (for
    messages)."""
    assert header.sums is not None
    if header.sums.tokens is not None:
        check_token_blocks(path, header, first_sample)
    data = (
        np.memmap(path, dtype=np.uint8, mode="r")
        if os.path.getsize(path)
        else np.zeros(0, np.uint8)
    )
    for key, e in sorted(header.entries.items(), key=lambda kv: kv[1].start):
        if key not in header.sums.sums:  # a ragged tensor or the block sums: checked above
            continue
        rows = e.shape[0] if e.shape else 0
        if not rows:
            continue
        got = np.asarray(byte_row_sums(memoryview(data[e.start : e.end]), rows), dtype=np.uint64)
        bad = np.flatnonzero(got != np.frombuffer(header.sums.sums[key], dtype=np.uint64))
        if bad.size:
            r = int(bad[0])
            want = int(header.sums.sums[key][r])
            raise checksum_mismatch(
                path, r, first_sample, key, want, int(got[r]), read=False, more=bad.size - 1
            )


def verify_shard_file(
    path: str,
    schema: CacheSchema | None,
    rows: int,
    record: Mapping[str, Any] | None = None,
    require_sums: bool = False,
    first_sample: int | None = None,
) -> ShardCheck:
    """Check one shard completely; raise :class:`CacheIntegrityError` naming it on the first
    problem.

    ``first_sample``: the global index of the shard's row 0, so that a damaged row is named by
    its sample (``None``: by its row of the shard only).

    Header against ``schema`` and ``rows`` (:func:`check_shard_header`), every
    row against the shard's own checksums (when it carries them;
    ``require_sums`` makes their absence an error), and -- given the manifest's
    ``record`` (``{"bytes", "checksum"}``) -- the file's size and its checksum:
    the header digest a te_thd manifest records, or the whole-file CRC-32 that
    manifests of older te_thd versions record (computed then; see docs/integrity.md).
    """
    expected = str(record["checksum"]) if record is not None else None
    algo = expected.split(":", 1)[0] if expected is not None else None
    if algo not in (None, HASH_NAME, LEGACY_CHECKSUM):
        raise CacheIntegrityError(
            f"shard {path}: checksum algorithm {algo!r} is not supported (expected {HASH_NAME!r}, "
            f"or {LEGACY_CHECKSUM!r} in caches of older te_thd versions)",
            path=path,
        )
    header = check_shard_header(path, schema, rows, require_sums=require_sums, checksum=expected)
    if header.sums is not None:
        _check_row_sums(path, header, first_sample)
    size = os.stat(path).st_size
    if algo == LEGACY_CHECKSUM or (algo is None and header.sums is None):
        checksum = _file_crc32(path)
    else:
        # check_shard_header: a digest record needs the te_thd fields
        assert header.sums is not None
        checksum = shard_checksum(header.sums.digest)
    if record is not None:
        assert expected is not None
        if checksum != expected or size != int(record["bytes"]):
            raise CacheIntegrityError(
                f"shard {path}: checksum {checksum} ({size} bytes) differs from the manifest's "
                f"{expected} ({record['bytes']} bytes): the file is corrupt or was replaced",
                path=path,
                expected=expected,
                actual=checksum,
            )
    return ShardCheck(header, size, checksum)
