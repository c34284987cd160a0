"""The per-call costs behind small choices in ``te_thd/offline_cache``, measured on this machine.

    PYTHONPATH=$PWD .venv/bin/python perf/measure_code_choices.py

Each line times one choice the code makes against the alternative it avoids (best of 5
repeats, per call; single thread). docs/performance-io.md ("Figures behind the code's
choices") records what this printed when the choices were made; the code's comments
say only why. A choice is worth revisiting when its ratio here flips.
"""

from __future__ import annotations

import array
import dataclasses
import os
import timeit
import zlib
from collections.abc import Callable

import numpy as np
import torch
import xxhash

from te_thd.offline_cache.format.integrity import byte_view, row_views
from te_thd.offline_cache.format.schema import TensorSpec
from te_thd.offline_cache.read.executor import Piece


def per_call_us(fn: Callable[[], object], number: int = 20000) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def line(what: str, ours: float, other: float, unit: str = "us") -> None:
    print(f"{what:58s} {ours:9.3f} {unit}  vs {other:9.3f} {unit}  ({other / ours:.1f}x)")


def main() -> None:
    frozen = dataclasses.make_dataclass("FrozenPiece", Piece._fields, frozen=True)
    args = (3, 0, [], 4096, "p", None, (0, ()), None)
    line(
        "Piece: NamedTuple vs frozen dataclass, build one",
        per_call_us(lambda: Piece(*args)),
        per_call_us(lambda: frozen(*args)),
    )

    t = torch.zeros(8, 2048, dtype=torch.uint8)
    line("byte_view(t) vs t.view(torch.uint8).numpy()", per_call_us(lambda: byte_view(t)),
         per_call_us(lambda: memoryview(t.view(torch.uint8).numpy())))  # fmt: skip

    sums = array.array("Q", range(4096))
    nsums = np.asarray(sums)
    rows = [5, 9, 100, 7, 3000, 12, 44, 801]
    line("8 row sums: array by Python index vs numpy fancy index", per_call_us(lambda: [sums[r] for r in rows]),
         per_call_us(lambda: nsums[rows]))  # fmt: skip

    views = row_views(t, 8)
    line(
        "8 rows' bytes: a slice of row views vs a tensor slice",
        per_call_us(lambda: views[2:6]),
        per_call_us(lambda: t[2:6]),
    )
    seeds = list(range(8))
    hashed = per_call_us(lambda: list(map(xxhash.xxh3_64_intdigest, views, seeds)))
    loop = per_call_us(lambda: [xxhash.xxh3_64_intdigest(views[i], seeds[i]) for i in range(8)])
    line("hash 8 rows of 2 KiB: map() vs indexed loop", hashed, loop)

    want = TensorSpec(torch.float32, (4096,))
    h = torch.zeros(2, 4096)
    line("schema check: compare fields vs build a TensorSpec", per_call_us(lambda: h.dtype != want.dtype or tuple(h.shape[1:]) != want.shape),
         per_call_us(lambda: TensorSpec(h.dtype, tuple(h.shape[1:])) != want))  # fmt: skip

    row = os.urandom(2048)
    line("hash one 2 KiB row: xxh3_64 vs zlib.crc32", per_call_us(lambda: xxhash.xxh3_64_intdigest(row, 1)),
         per_call_us(lambda: zlib.crc32(row)))  # fmt: skip
    big = os.urandom(64 << 20)
    gbs = [(64 << 20) / min(timeit.repeat(lambda f=f: f(big), number=3, repeat=3)) * 3 / 1e9
           for f in (xxhash.xxh3_64_intdigest, zlib.crc32)]  # fmt: skip
    print(
        f"{'hash 64 MiB: xxh3_64 vs zlib.crc32 (GB/s, higher is better)':58s} {gbs[0]:9.2f} GB/s vs {gbs[1]:9.2f} GB/s"
    )


if __name__ == "__main__":
    main()
