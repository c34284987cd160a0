"""Fuzz of te_thd.packing (PackingCollator, seq_lens_from_position_ids) with arbitrary samples.

Every call either returns exactly what the loop oracle below computes, or raises
``ValueError``. The oracle is written from the collator's documented contract, one
document and one slot at a time:

* real length ``min(n, S)`` (longer documents only with ``overlong="truncate"``),
  span ``ceil(real / m) * m``;
* rows by first fit over the spans (decreasing span, ties in arrival order, for
  ``"ffd"``; arrival order for ``"first_fit"``) -- each document into the lowest row
  with room; documents of a row in arrival order; the row's unused tail joins its
  last document, so every non-empty row's spans sum to S;
* tokens then ``pad_token_id``; labels shifted by one INSIDE each document (the
  last real slot gets -100, unless the document was truncated: then its real next
  target), -100 on padding; ``labels_shifted=True`` keeps labels as given;
* position ids ``0 .. span-1`` per document; every other per-token key packed the
  same way with its ``pad_values`` filler;
* ``seq_lens`` / ``seq_lens_padded`` ``[B, P]`` with the (negative) sentinel;
  ``packing_efficiency`` = real tokens / (B * S).

Finally every well-formed packed batch must go through ``process_input_for_thd``,
``te_attention_kwargs`` (whose kwargs must pass ``check_te_thd_args``) and the CP
sharding of ``te_thd.cp`` (when ``pad_to_multiple_of = 2 * cp``; each rank's kwargs
pass the CP contract too), and the CP shards of all ranks must hold every real
token exactly once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from _fuzz_support import EITHER, FUZZ, INVALID, VALID, count, expect
from hypothesis import given
from hypothesis import strategies as st

from te_thd import attention as at
from te_thd import cp as tcp
from te_thd import packing as tp
from te_thd import thd_utils as tu

IGNORE = -100


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# --------------------------------------------------------------------------- oracle


def ctor_verdict(kw: dict[str, Any]) -> tuple[str, str]:
    s, m = kw["seq_len"], kw["pad_to_multiple_of"]
    if not _is_int(s) or s < 1:
        return INVALID, f"seq_len={s!r}"
    if not _is_int(m) or m < 1:
        return INVALID, f"pad_to_multiple_of={m!r}"
    if s % m:
        return INVALID, "seq_len not a multiple"
    if kw["overlong"] not in ("truncate", "raise"):
        return INVALID, f"overlong={kw['overlong']!r}"
    if not _is_int(kw["seq_lens_padding_value"]) or kw["seq_lens_padding_value"] >= 0:
        return INVALID, "sentinel"
    if kw["rows"] is not None and (not _is_int(kw["rows"]) or kw["rows"] < 1):
        return INVALID, f"rows={kw['rows']!r}"
    if kw["bin_packing"] not in ("ffd", "first_fit"):
        return INVALID, f"bin_packing={kw['bin_packing']!r}"
    return VALID, "constructor ok"


def first_fit(spans: list[int], cap: int, decreasing: bool) -> list[int]:
    order = (
        sorted(range(len(spans)), key=lambda i: -spans[i])
        if decreasing
        else list(range(len(spans)))
    )
    room: list[int] = []
    bins = [0] * len(spans)
    for i in order:
        for b, r in enumerate(room):
            if r >= spans[i]:
                room[b] -= spans[i]
                bins[i] = b
                break
        else:
            room.append(cap - spans[i])
            bins[i] = len(room) - 1
    return bins


def call_verdict(kw: dict[str, Any], samples: Any) -> tuple[str, str]:
    input_key = kw["input_key"]
    if isinstance(samples, Mapping):
        return EITHER, "flattened batch (checked by its own fuzz)"
    if len(samples) == 0:
        return INVALID, "no samples"
    first = samples[0]
    if not isinstance(first, Mapping) or input_key not in first:
        return INVALID, "sample 0 lacks the input key"
    keys = set(first)
    for i, s in enumerate(samples):
        if not isinstance(s, Mapping) or set(s) != keys:
            return INVALID, f"sample {i} keys"
        ids = s[input_key]
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1:
            return INVALID, f"sample {i} input not 1-D"
        n = ids.shape[0]
        if n == 0:
            return INVALID, f"sample {i} empty"
        for k, v in s.items():
            if k == "position_ids":
                continue
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != (n,):
                return INVALID, f"sample {i}[{k}] shape"
        if n > kw["seq_len"] and kw["overlong"] == "raise":
            return INVALID, f"sample {i} overlong"
    if input_key != "input_ids" and "input_ids" in keys:
        return (
            INVALID,
            "a per-token key named 'input_ids' collides with the packed tokens (finding B5)",
        )
    label_key = kw["label_key"]
    if "labels" in keys and label_key != "labels":
        return EITHER, "a 'labels' key that is not the label key"
    if keys & {"seq_lens", "seq_lens_padded", "packing_efficiency"}:
        return EITHER, "a sample key named like a layout output"
    S, m = kw["seq_len"], kw["pad_to_multiple_of"]
    spans = [-(-min(s[input_key].shape[0], S) // m) * m for s in samples]
    n_bins = max(first_fit(spans, S, kw["bin_packing"] == "ffd")) + 1
    if kw["rows"] is not None and n_bins > kw["rows"]:
        return INVALID, f"{n_bins} rows needed > rows={kw['rows']}"
    return VALID, "well-formed"


def pack_oracle(kw: dict[str, Any], samples: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    S, m = kw["seq_len"], kw["pad_to_multiple_of"]
    input_key, label_key, sentinel = kw["input_key"], kw["label_key"], kw["seq_lens_padding_value"]
    n = [s[input_key].shape[0] for s in samples]
    real = [min(x, S) for x in n]
    spans = [-(-r // m) * m for r in real]
    bins = first_fit(spans, S, kw["bin_packing"] == "ffd")
    n_bins = max(bins) + 1
    B = n_bins if kw["rows"] is None else kw["rows"]
    rows: list[list[int]] = [[i for i in range(len(samples)) if bins[i] == b] for b in range(B)]
    P = max(len(r) for r in rows)
    other = [k for k in samples[0] if k not in (input_key, "position_ids") and k != label_key]
    dtype = samples[0][input_key].dtype
    out: dict[str, Any] = {
        "input_ids": torch.full((B, S), kw["pad_token_id"], dtype=dtype),
        "labels": torch.full((B, S), IGNORE, dtype=torch.long),
        "position_ids": torch.zeros((B, S), dtype=torch.long),
        "seq_lens": torch.full((B, P), sentinel, dtype=torch.long),
        "seq_lens_padded": torch.full((B, P), sentinel, dtype=torch.long),
    }
    for k in other:
        out[k] = torch.full((B, S), kw["pad_values"].get(k, 0), dtype=samples[0][k].dtype)
    real_tokens = 0
    for b, docs in enumerate(rows):
        off = 0
        for j, i in enumerate(docs):
            span = spans[i] + (S - sum(spans[d] for d in docs) if j == len(docs) - 1 else 0)
            r = real[i]
            s = samples[i]
            out["seq_lens"][b, j] = r
            out["seq_lens_padded"][b, j] = span
            out["input_ids"][b, off : off + r] = s[input_key][:r]
            src = s[label_key] if (label_key is not None and label_key in s) else s[input_key]
            for t in range(r):
                if kw["labels_shifted"]:
                    out["labels"][b, off + t] = int(src[t])
                elif t + 1 < n[i]:
                    out["labels"][b, off + t] = int(src[t + 1])
                # else: the document's last token keeps -100
            for t in range(span):
                out["position_ids"][b, off + t] = t
            for k in other:
                out[k][b, off : off + r] = s[k][:r]
            off += span
            real_tokens += r
    out["packing_efficiency"] = real_tokens / (B * S)
    out["_n_bins"] = n_bins
    return out


def check_packed(got: dict[str, Any], want: dict[str, Any]) -> None:
    n_bins = want.pop("_n_bins")
    for k, v in want.items():
        if k == "packing_efficiency":
            assert abs(got[k] - v) < 1e-12, (got[k], v)
            continue
        g = got[k]
        if k == "labels":
            g = g.long()
        if k == "position_ids":  # rows without documents: positions are unspecified
            g, v = g[:n_bins], v[:n_bins]
        assert g.shape == v.shape and torch.equal(g.to(v.dtype), v), (k, g, v)
        if k != "labels":
            assert got[k].dtype == want[k].dtype, (k, got[k].dtype, want[k].dtype)


# --------------------------------------------------------------------------- strategies

CALL_MUTATIONS = (
    "empty_list",
    "not_mapping",
    "drop_input",
    "extra_key",
    "input_2d",
    "empty_sample",
    "key_length",
    "key_not_tensor",
    "collide_input_ids",
    "flattened",
)


@st.composite
def packer_cases(draw) -> tuple[dict[str, Any], Any]:
    cp = draw(st.sampled_from([1, 1, 2, 4]))
    m = tp.pad_to_multiple_for(cp)
    kw: dict[str, Any] = {
        "seq_len": m * draw(st.integers(1, 8)),
        "pad_to_multiple_of": m,
        "overlong": draw(st.sampled_from(["raise", "truncate"])),
        "label_key": draw(st.sampled_from(["labels", "labels", None])),
        "input_key": "input_ids",
        "pad_token_id": draw(st.sampled_from([0, -1, 7])),
        "seq_lens_padding_value": draw(st.sampled_from([-1000, -1])),
        "rows": draw(st.sampled_from([None, None, 1, 2, 5])),
        "labels_shifted": draw(st.booleans()),
        "pad_values": {"loss_mask": draw(st.sampled_from([0, 1]))},
        "bin_packing": draw(st.sampled_from(["ffd", "first_fit"])),
        "_cp": cp,
    }
    ctor_mut = draw(
        st.sampled_from(
            [None] * 24 + ["seq_len", "multiple", "overlong", "sentinel", "rows", "bin_packing"]
        )
    )
    if ctor_mut == "seq_len":
        kw["seq_len"] = draw(st.sampled_from([0, -4, True, 2.5, kw["seq_len"] + 1]))
    elif ctor_mut == "multiple":
        kw["pad_to_multiple_of"] = draw(st.sampled_from([0, -2, True, 3, 5]))
    elif ctor_mut == "overlong":
        kw["overlong"] = "wrap"
    elif ctor_mut == "sentinel":
        kw["seq_lens_padding_value"] = draw(st.sampled_from([0, 5, True, -1.0]))
    elif ctor_mut == "rows":
        kw["rows"] = draw(st.sampled_from([0, -1, True]))
    elif ctor_mut == "bin_packing":
        kw["bin_packing"] = "best_fit"
    n = draw(st.integers(1, 8))
    with_labels = draw(st.booleans())
    with_mask = draw(st.booleans())
    with_pos = draw(st.booleans())
    samples: list[Any] = []
    for i in range(n):
        ln = draw(st.integers(1, 40))
        ids = 1000 * (i + 1) + torch.arange(ln)
        s: dict[str, Any] = {"input_ids": ids}
        if with_labels:
            lab = ids + 5
            lab[torch.arange(ln) % 4 == 1] = IGNORE
            s["labels"] = lab
        if with_mask:
            s["loss_mask"] = torch.arange(ln) % 3 != 0
        if with_pos:
            s["position_ids"] = torch.zeros(draw(st.integers(0, 3)), dtype=torch.long)  # ignored
        samples.append(s)
    mut = draw(st.sampled_from([None] * 16 + list(CALL_MUTATIONS)))
    j = draw(st.integers(0, n - 1))
    if mut == "empty_list":
        samples = []
    elif mut == "not_mapping":
        samples[j] = list(samples[j].items())
    elif mut == "drop_input":
        samples[j].pop("input_ids")
    elif mut == "extra_key":
        samples[j]["extra"] = torch.zeros(samples[j]["input_ids"].shape[0])
    elif mut == "input_2d":
        samples[j]["input_ids"] = samples[j]["input_ids"].reshape(1, -1)
    elif mut == "empty_sample":
        samples[j] = {k: v[:0] for k, v in samples[j].items()}
    elif mut == "key_length" and (with_labels or with_mask):
        k = "labels" if with_labels else "loss_mask"
        samples[j][k] = (
            samples[j][k][:-1] if samples[j][k].shape[0] > 1 else samples[j][k].repeat(2)
        )
    elif mut == "key_not_tensor":
        samples[j]["input_ids"] = samples[j]["input_ids"].tolist()
    elif mut == "collide_input_ids":
        kw["input_key"] = "tokens"
        for s in samples:
            s["tokens"] = s["input_ids"]
    elif mut == "flattened":
        samples = {
            "input_ids": torch.cat([s["input_ids"] for s in samples]),
            "position_ids": torch.cat([torch.arange(s["input_ids"].shape[0]) for s in samples]),
        }
    return kw, samples


# --------------------------------------------------------------------------- tests


def _collator(kw: dict[str, Any]):
    args = {k: v for k, v in kw.items() if not k.startswith("_")}
    return tp.PackingCollator(**args)


@FUZZ
@given(packer_cases())
def test_fuzz_packing_collator(case) -> None:
    kw, samples = case
    verdict, why = ctor_verdict(kw)
    coll = expect("packing.PackingCollator()", verdict, lambda: _collator(kw), why)
    if coll is None:
        return
    verdict, why = call_verdict(kw, samples)
    got = expect("packing.PackingCollator.__call__", verdict, lambda: coll(samples), why)
    if got is None:
        return
    if verdict == VALID:
        check_packed(got, pack_oracle(kw, samples))
    _check_downstream(kw, got)


def _check_downstream(kw: dict[str, Any], packed: dict[str, Any]) -> None:
    """A packed batch converts to THD and shards for CP; the CP shards hold each real token once."""
    thd = tu.process_input_for_thd(
        {k: v for k, v in packed.items() if k != "packing_efficiency"},
        seq_lens_padding_value=kw["seq_lens_padding_value"],
    )
    real_positions = (~thd["padding_mask"]).nonzero().view(-1).tolist()
    total = thd["input_ids"].shape[0]
    # TE's kwargs for the converted batch satisfy TE's THD contract (checked on the host)
    te_kw = at.te_attention_kwargs(thd)
    q = torch.zeros(total, 2, 4)
    at.check_te_thd_args(q, q, q, **te_kw)
    assert te_kw["pad_between_seqs"] is thd["pad_between_seqs"]
    cp = kw["_cp"]
    if kw["pad_to_multiple_of"] % (2 * cp) or cp == 1:
        return
    seen: list[int] = []
    for r in range(cp):
        shard = tcp.shard_thd_batch_for_cp(
            {**thd, "token_index": torch.arange(thd["input_ids"].shape[0])},
            cp,
            r,
            extra_keys=("token_index",),
        )
        keep = ~shard["padding_mask"]
        seen += shard["token_index"][keep].tolist()
        local = torch.zeros(total // cp, 2, 4)
        at.check_te_thd_args(local, local, local, cp_size=cp, **at.te_attention_kwargs(shard))
        assert torch.equal(shard["input_ids"], thd["input_ids"][shard["token_index"]])
    assert sorted(seen) == real_positions
    _check_chunked_cp(kw, packed, cp)


def _check_chunked_cp(kw: dict[str, Any], packed: dict[str, Any], cp: int) -> None:
    """Each chunk of ``split_batch_into_thd_chunks`` (sentinel-padded boundary rows) shards for
    CP exactly like its trimmed boundaries, with the host count ``num_seqs`` or without it."""
    rows = packed["input_ids"].shape[0]
    if rows < 2:
        return
    batch = {k: v for k, v in packed.items() if k != "packing_efficiency"}
    sentinel = kw["seq_lens_padding_value"]
    try:
        chunked = tu.split_batch_into_thd_chunks(batch, rows, sentinel)
    except ValueError as e:  # a chunk whose first row is empty (rows=... with fewer documents)
        assert "holds no sequence" in str(e), e
        return
    for c in range(rows):
        n = chunked["num_seqs"][c]
        cu = chunked["cu_seqlens_padded"][c]
        assert (cu[n + 1 :] == sentinel).all()
        tokens = chunked["input_ids"][c]
        one = {
            "input_ids": tokens,
            "padding_mask": chunked["padding_mask"][c],
            "cu_seqlens_padded": cu,
            "cu_seqlens": chunked["cu_seqlens"][c],
        }
        trimmed = {
            **one,
            "cu_seqlens_padded": cu[: n + 1],
            "cu_seqlens": chunked["cu_seqlens"][c][: n + 1],
        }
        for r in range(cp):
            want = tcp.shard_thd_batch_for_cp(trimmed, cp, r)
            for num_seqs in (n, None):
                got = tcp.shard_thd_batch_for_cp(one, cp, r, num_seqs=num_seqs)
                assert torch.equal(got["input_ids"], want["input_ids"]), (c, r, num_seqs)
                assert torch.equal(got["padding_mask"], want["padding_mask"]), (c, r, num_seqs)
    count("cp.shard of a chunked row", "result")


@st.composite
def position_streams(draw) -> list[int]:
    """Hugging Face flattening position ids, then maybe one garbage entry."""
    pos: list[int] = []
    for n in draw(st.lists(st.integers(1, 5), max_size=5)):
        pos += list(range(n))
    if pos and draw(st.booleans()):
        pos[draw(st.integers(0, len(pos) - 1))] = draw(st.integers(-2, 6))
    return pos


@FUZZ
@given(position_streams(), st.sampled_from(["1d", "1d", "2d", "float", "bool", "3d"]))
def test_fuzz_seq_lens_from_position_ids(pos: list[int], shape: str) -> None:
    """Valid iff the stream starts at 0 and every id is 0 or its predecessor + 1 (per row start 0)."""
    t = torch.tensor(pos, dtype=torch.long)
    rows = 1
    if shape == "2d" and len(pos) % 2 == 0 and pos:
        t, rows = t.reshape(2, -1), 2
    elif shape == "float":
        t = t.float()
    elif shape == "bool":
        t = t.bool()
    elif shape == "3d":
        t = t.reshape(1, 1, -1)
    verdict, why = VALID, "ok"
    if shape in ("float", "bool"):
        verdict, why = INVALID, "dtype"
    elif shape == "3d":
        verdict, why = INVALID, "3-D"
    elif pos:
        width = len(pos) // rows
        row_starts = [pos[r * width] for r in range(rows)]
        if any(s != 0 for s in row_starts):
            verdict, why = INVALID, "a row does not start at 0"
        elif any(not (b == 0 or b == a + 1) for a, b in zip(pos, pos[1:], strict=False)):
            verdict, why = INVALID, "not 0 or predecessor + 1"
    out = expect(
        "packing.seq_lens_from_position_ids", verdict, lambda: tp.seq_lens_from_position_ids(t), why
    )
    if out is None:
        return
    lengths, run = [], 0
    for k, p in enumerate(pos):
        if p == 0 and k:
            lengths.append(run)
            run = 0
        run += 1
    if pos:
        lengths.append(run)
    assert out.dtype == torch.int64 and out.tolist() == lengths


# ----------------------------------------------------------- pinned fuzz findings


def test_fuzz_finding_B5_sample_key_named_input_ids_never_replaces_the_tokens() -> None:
    """input_key='tokens' and a per-token key 'input_ids': the output must not mix them."""
    coll = tp.PackingCollator(8, input_key="tokens")
    sample = {"tokens": torch.tensor([1, 2, 3]), "input_ids": torch.tensor([7, 8, 9])}
    try:
        out = coll([sample])
    except ValueError as e:
        assert "input_ids" in str(e)
        return
    # was: input_ids [7, 8, 9, 0...] (the other key) with labels [2, 3, -100] (from tokens)
    assert out["input_ids"][0, :3].tolist() == [1, 2, 3], out["input_ids"]
