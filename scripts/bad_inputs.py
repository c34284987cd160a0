"""The bad-input catalogue: every condition te_thd validates, in one data structure.

Each :class:`BadInput` row is a tiny program that provokes exactly one validation
error, the exception type it must raise, and a regular expression its message must
match. Two consumers read this list, so the docs page and the tests cannot drift:

* ``tests/test_bad_input_catalogue.py`` runs every row and asserts type and message;
* ``scripts/gen_bad_input_table.py`` runs every row and writes the table in ``docs/bad-inputs.md``
  from the messages actually raised.

A row whose ``kind`` is ``"cli"`` runs ``te-thd`` (``te_thd.cli.main``) in-process
and expects a non-zero exit status with the message on stderr instead of an
exception.

Adding a row: write a ``trigger(tmp)`` that raises (``tmp`` is an empty scratch
directory), pick the narrowest ``match`` that still names the argument, the
offending value and the fix, then run ``scripts/gen_bad_input_table.py --write``.
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crash_test import IndexDataset

#: Areas in the order the docs table lists them (the path a batch takes, then the cache).
AREAS = ("THD", "CP", "packing", "attention", "cache", "CLI")


@dataclass(frozen=True)
class BadInput:
    """One validated condition.

    ``trigger(tmp)`` must raise ``exc`` (``kind="raises"``) or, for ``kind="cli"``,
    return ``(exit_status, stderr_text)`` with a non-zero status. ``match`` is a
    regular expression searched in the message as the docs table prints it
    (:func:`normalise`: the scratch directory shown as ``<dir>``, whitespace
    collapsed, ``redact`` applied). ``redact`` lists ``(pattern, replacement)``
    pairs for volatile values (process ids, host names).
    """

    id: str
    area: str
    condition: str
    trigger: Callable[[Path], Any]
    match: str
    exc: type[BaseException] = ValueError
    kind: str = "raises"
    redact: tuple[tuple[str, str], ...] = ()


class DidNotRaise(AssertionError):
    """A catalogue row's trigger returned normally: the condition is not validated."""


def provoke(case: BadInput, tmp: Path) -> tuple[type[BaseException] | None, str]:
    """Run ``case`` in the scratch directory ``tmp``; return (exception type, message).

    For CLI rows the type is None and the message is stderr (plus stdout when stderr
    is empty). Raises :class:`DidNotRaise` when nothing failed, and re-raises an
    exception of a type other than ``case.exc`` unchanged, so a test sees it as is.
    """
    if case.kind == "cli":
        status, text = case.trigger(tmp)
        if status == 0:
            raise DidNotRaise(f"{case.id}: te-thd exited 0; output: {text!r}")
        return None, text
    try:
        case.trigger(tmp)
    except case.exc as e:  # noqa: PERF203 - one call
        return type(e), str(e)
    raise DidNotRaise(f"{case.id}: {case.condition!r} did not raise {case.exc.__name__}")


def run_cli(argv: list[str]) -> tuple[int, str]:
    """Run ``te-thd argv`` in-process; return (exit status, stderr or stdout text)."""
    from te_thd.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as e:  # argparse errors
            status = e.code if isinstance(e.code, int) else 1
    text = err.getvalue().strip() or out.getvalue().strip()
    return int(status or 0), text


def normalise(case: BadInput, message: str, tmp: Path) -> str:
    """Message as the docs table prints it: scratch paths and volatile values redacted."""
    message = message.replace(str(tmp.resolve()), "<dir>").replace(str(tmp), "<dir>")
    for pattern, repl in case.redact:
        message = re.sub(pattern, repl, message)
    return " ".join(message.split())


# ---------------------------------------------------------------------------
# Rows, grouped by area. Helpers build the smallest valid input and break one thing.
# ---------------------------------------------------------------------------

CASES: list[BadInput] = []


def _re(text: str) -> str:
    """A literal fragment of a message as a regex."""
    return re.escape(text)


# ------------------------------------------------------------------------------- THD


def _thd_batch(**override: Any) -> dict[str, Any]:
    """The reference page's 2x6 example, with keys replaced (``None`` drops a key)."""
    import torch

    batch: dict[str, Any] = {
        "input_ids": torch.tensor([[1, 2, 3, 99, 4, 5], [6, 7, 8, 9, 10, 11]]),
        "labels": torch.tensor([[2, 3, 99, 4, 5, 6], [7, 8, 9, 10, 11, 12]]),
        "position_ids": torch.tensor([[0, 1, 2, 0, 0, 1], [0, 1, 2, 3, 4, 5]]),
        "seq_lens": torch.tensor([[3, 2], [6, -1000]]),
        "seq_lens_padded": torch.tensor([[4, 2], [6, -1000]]),
    }
    for k, v in override.items():
        if v is _DROP:
            batch.pop(k, None)
        else:
            batch[k] = v
    return batch


_DROP = object()


def _thd(**override: Any) -> Callable[[Path], Any]:
    def run(_: Path) -> Any:
        from te_thd.thd_utils import process_input_for_thd

        return process_input_for_thd(_thd_batch(**override))

    return run


def _t(data: Any, **kw: Any) -> Any:
    import torch

    return torch.tensor(data, **kw)


def _thd_rows() -> list[BadInput]:
    import torch

    from te_thd import thd_utils as tu

    def big(_: Path) -> None:
        huge = torch.zeros(1, dtype=torch.long).expand(2, 2**31)  # no memory: stride 0
        tu.process_input_for_thd(
            {"input_ids": huge, "position_ids": huge, "seq_lens": _t([[4], [4]])}
        )

    def split(num_chunks: Any, **override: Any) -> Callable[[Path], Any]:
        def run(_: Path) -> Any:
            batch = _thd_batch(**override)
            return tu.split_batch_into_thd_chunks(batch, num_chunks)

        return run

    four = {
        "input_ids": torch.arange(24).reshape(4, 6),
        "labels": torch.arange(24).reshape(4, 6),
        "position_ids": torch.arange(6).repeat(4, 1),
        "seq_lens": _t([[6], [6], [-1000], [6]]),
        "seq_lens_padded": _t([[6], [6], [-1000], [6]]),
    }
    return [
        BadInput(
            "thd-batch-not-mapping",
            "THD",
            "batch is not a dict",
            lambda _: tu.process_input_for_thd([1, 2]),
            _re("batch must be a dict of tensors, got list"),
        ),
        BadInput(
            "thd-missing-key",
            "THD",
            "a required key (input_ids, position_ids, seq_lens) is missing",
            _thd(position_ids=_DROP),
            _re("batch is missing required key(s) ['position_ids']"),
        ),
        BadInput(
            "thd-not-tensor",
            "THD",
            "a batch entry is not a tensor",
            _thd(input_ids=[[1, 2]]),
            _re("batch['input_ids'] must be a torch.Tensor, got list"),
        ),
        BadInput(
            "thd-input-rank",
            "THD",
            "input_ids is neither [B, S] nor [B, S, H]",
            _thd(input_ids=torch.arange(12)),
            _re("input_ids must be [B, S] token ids or [B, S, H] embeddings, got shape (12,)"),
        ),
        BadInput(
            "thd-position-shape",
            "THD",
            "position_ids is neither [B, S] nor [n_rope, B, S]",
            _thd(position_ids=torch.zeros(2, 5, dtype=torch.long)),
            _re("position_ids shape (2, 5) does not match the batch [B, S]=[2, 6]"),
        ),
        BadInput(
            "thd-labels-shape",
            "THD",
            "labels is not [B, S]",
            _thd(labels=torch.zeros(2, 5, dtype=torch.long)),
            _re("labels shape (2, 5) does not match the batch [B, S]=[2, 6]"),
        ),
        BadInput(
            "thd-length-dtype",
            "THD",
            "seq_lens / seq_lens_padded have a non-integer dtype",
            _thd(seq_lens=_t([[3.0, 2.0], [6.0, -1000.0]])),
            _re("seq_lens must have an integer dtype, got torch.float32"),
        ),
        BadInput(
            "thd-length-shape",
            "THD",
            "seq_lens is not [B, P]",
            _thd(seq_lens=_t([3, 2, 6, -1000])),
            _re("seq_lens must be [B, P] with B=2 (input_ids.shape[0]), got shape (4,)"),
        ),
        BadInput(
            "thd-length-rows",
            "THD",
            "seq_lens has another number of rows than the batch",
            _thd(seq_lens=_t([[3, 2], [6, -1000], [1, -1000]])),
            _re("seq_lens must be [B, P] with B=2 (input_ids.shape[0]), got shape (3, 2)"),
        ),
        BadInput(
            "thd-padded-shape",
            "THD",
            "seq_lens_padded and seq_lens differ in shape",
            _thd(seq_lens_padded=_t([[4, 2, -1000], [6, -1000, -1000]])),
            _re("seq_lens_padded shape (2, 3) does not match seq_lens shape (2, 2)"),
        ),
        BadInput(
            "thd-sentinel-mismatch",
            "THD",
            "the sentinel marks a slot in only one of the two tables",
            _thd(seq_lens_padded=_t([[4, 2], [6, 1]])),
            _re(
                "seq_lens and seq_lens_padded disagree on unused pack slots: at [1, 1] seq_lens=-1000 but seq_lens_padded=1"
            ),
        ),
        BadInput(
            "thd-nonpositive-length",
            "THD",
            "a length <= 0 that is not the sentinel",
            _thd(seq_lens=_t([[3, 0], [6, -1000]])),
            _re(
                "seq_lens[0, 1]=0 is not a positive length and not the sentinel seq_lens_padding_value=-1000"
            ),
        ),
        BadInput(
            "thd-real-gt-padded",
            "THD",
            "seq_lens > seq_lens_padded",
            _thd(seq_lens=_t([[5, 2], [6, -1000]]), seq_lens_padded=_t([[4, 2], [6, -1000]])),
            _re("seq_lens[0, 0]=5 exceeds seq_lens_padded[0, 0]=4"),
        ),
        BadInput(
            "thd-row-over-s",
            "THD",
            "a row's padded lengths exceed S",
            _thd(seq_lens=_t([[3, 2], [6, -1000]]), seq_lens_padded=_t([[4, 3], [6, -1000]])),
            _re("seq_lens_padded row 0 occupies 7 slots but the batch rows hold S=6 tokens"),
        ),
        BadInput(
            "thd-row-overflow",
            "THD",
            "lengths so large that a row's sum wraps around int64",
            _thd(
                seq_lens=_t([[2**63 - 1, 2**63 - 1], [6, -1000]]),
                seq_lens_padded=_t([[2**63 - 1, 2**63 - 1], [6, -1000]]),
            ),
            r"seq_lens.*(row 0|\[0, 0\]).*S=6",
        ),
        BadInput(
            "thd-first-row-empty",
            "THD",
            "the first row holds no sequence",
            _thd(
                seq_lens=_t([[-1000, -1000], [6, -1000]]),
                seq_lens_padded=_t([[-1000, -1000], [6, -1000]]),
            ),
            _re("seq_lens row 0 holds no sequence (every slot is the sentinel -1000)"),
        ),
        BadInput(
            "thd-padded-without-real",
            "THD",
            "seq_lens is None but seq_lens_padded is given",
            _thd(seq_lens=None),
            _re("seq_lens is None but seq_lens_padded is given"),
        ),
        BadInput(
            "thd-pad-id-collision",
            "THD",
            "no pack metadata and the pad id is also content",
            _thd(
                seq_lens=None,
                seq_lens_padded=_DROP,
                input_ids=_t([[1, 0, 3, 4, 5, 6], [6, 7, 8, 9, 10, 0]]),
            ),
            _re(
                "padding_token_id=0 also occurs as content (input_ids[1] is the pad id but a non-pad token follows it)"
            ),
        ),
        BadInput(
            "thd-fallback-embeddings",
            "THD",
            "no pack metadata and input_ids are embeddings",
            _thd(seq_lens=None, seq_lens_padded=_DROP, input_ids=torch.zeros(2, 6, 4)),
            _re("padding can only be inferred from integer token ids [B, S]"),
        ),
        BadInput(
            "thd-stream-int32",
            "THD",
            "B*S tokens do not fit int32 boundaries",
            big,
            _re("input_ids holds 4294967296 tokens per converted stream"),
        ),
        BadInput(
            "thd-mask-ids-rank",
            "THD",
            "thd_padding_mask_from_token_ids: ids are not 1-D",
            lambda _: tu.thd_padding_mask_from_token_ids(torch.zeros(2, 3, dtype=torch.long), 0),
            _re("input_ids must be 1-D [total_tokens], got shape (2, 3)"),
        ),
        BadInput(
            "thd-mask-collision",
            "THD",
            "thd_padding_mask_from_token_ids: the pad id occurs before the tail",
            lambda _: tu.thd_padding_mask_from_token_ids(_t([5, 3, 7, 3]), 3),
            _re(
                "padding_token_id=3 also occurs as content (input_ids[1] is the pad id but a non-pad token follows it)"
            ),
        ),
        BadInput(
            "thd-layout-mask-negative",
            "THD",
            "_thd_padding_mask: a negative length",
            lambda _: tu._thd_padding_mask(8, _t([3, -1]), None, torch.device("cpu")),
            _re("valid_seq_lens[1]=-1 is negative"),
        ),
        BadInput(
            "thd-layout-mask-overflow",
            "THD",
            "_thd_padding_mask: sequences need more slots than total_tokens",
            lambda _: tu._thd_padding_mask(4, _t([3, 2]), _t([3, 2]), torch.device("cpu")),
            _re("the sequences occupy 5 slots but total_tokens=4"),
        ),
        BadInput(
            "thd-layout-mask-real-gt-padded",
            "THD",
            "_thd_padding_mask: real length > padded length",
            lambda _: tu._thd_padding_mask(8, _t([3, 2]), _t([2, 2]), torch.device("cpu")),
            _re("valid_seq_lens[0]=3 exceeds valid_seq_lens_padded[0]=2"),
        ),
        BadInput(
            "thd-chunks-type",
            "THD",
            "split_batch_into_thd_chunks: num_chunks is not an int",
            split(2.0),
            _re("num_chunks=2.0 must be an int"),
        ),
        BadInput(
            "thd-chunks-negative",
            "THD",
            "split_batch_into_thd_chunks: a negative num_chunks",
            split(-1),
            _re("num_chunks=-1 must be an int >= 0; pass the number of chunks"),
        ),
        BadInput(
            "thd-chunks-divide",
            "THD",
            "split_batch_into_thd_chunks: num_chunks does not divide B",
            split(3),
            _re("num_chunks=3 does not divide the batch size B=2 (input_ids.shape[0])"),
        ),
        BadInput(
            "thd-chunk-starts-empty",
            "THD",
            "split_batch_into_thd_chunks: a chunk's first row holds no sequence",
            lambda _: tu.split_batch_into_thd_chunks(four, 2),
            _re("seq_lens chunk 1 (batch row 2) holds no sequence"),
        ),
    ]


CASES.extend(_thd_rows())


# -------------------------------------------------------------------------------- CP


def _cp_rows() -> list[BadInput]:
    import torch

    from te_thd import cp

    cu = _t([0, 4, 8])

    def thd(**override: Any) -> dict[str, Any]:
        batch: dict[str, Any] = {
            "input_ids": torch.arange(8),
            "labels": torch.arange(8),
            "padding_mask": torch.zeros(8, dtype=torch.bool),
            "position_ids": torch.arange(8),
            "cu_seqlens": cu,
            "cu_seqlens_padded": cu,
        }
        for k, v in override.items():
            if v is _DROP:
                batch.pop(k, None)
            else:
                batch[k] = v
        return batch

    def part(
        c: Any, total: Any, size: Any, rank: Any, num_seqs: Any = None
    ) -> Callable[[Path], Any]:
        return lambda _: cp.partition_indices(c, total, size, rank, num_seqs)

    return [
        BadInput(
            "cp-size",
            "CP",
            "cp_size is not an int >= 1",
            part(cu, 8, 0, 0),
            _re("cp_size=0 must be an int >= 1"),
        ),
        BadInput(
            "cp-rank",
            "CP",
            "cp_rank is outside [0, cp_size)",
            part(cu, 8, 2, 2),
            _re("cp_rank=2 must be an int in [0, cp_size=2)"),
        ),
        BadInput(
            "cp-rank-none",
            "CP",
            "cp_rank is None",
            part(cu, 8, 2, None),
            _re("cp_rank=None must be an int in [0, cp_size=2)"),
        ),
        BadInput(
            "cp-boundaries-type",
            "CP",
            "the boundary array is not a tensor",
            part([0, 4, 8], 8, 2, 0),
            _re("cu_seqlens_padded must be a torch.Tensor, got list"),
        ),
        BadInput(
            "cp-boundaries-rank",
            "CP",
            "the boundary array is not 1-D (a chunked [C, maxN+1] batch)",
            part(cu.reshape(1, 3), 8, 2, 0),
            _re("cu_seqlens_padded must be 1-D [N+1], got shape (1, 3)"),
        ),
        BadInput(
            "cp-boundaries-dtype",
            "CP",
            "the boundary array is not integer",
            part(cu.float(), 8, 2, 0),
            _re("cu_seqlens_padded must have an integer dtype (int32/int64), got torch.float32"),
        ),
        BadInput(
            "cp-boundaries-empty",
            "CP",
            "the boundary array is empty",
            part(_t([], dtype=torch.long), 0, 2, 0),
            _re("cu_seqlens_padded must hold at least one boundary"),
        ),
        BadInput(
            "cp-num-seqs",
            "CP",
            "num_seqs is outside [0, len-1]",
            part(cu, 8, 2, 0, 5),
            _re("num_seqs=5 is out of range for cu_seqlens_padded of length 3"),
        ),
        BadInput(
            "cp-num-seqs-type",
            "CP",
            "shard_thd_batch_for_cp: num_seqs is not an int or None",
            lambda _: cp.shard_thd_batch_for_cp(thd(), 2, 0, num_seqs="2"),
            _re("num_seqs='2' must be an int or None"),
        ),
        BadInput(
            "cp-total-divisible",
            "CP",
            "total_tokens is not a multiple of 2*cp_size",
            part(_t([0, 6]), 6, 2, 0),
            _re("total_tokens=6 is not divisible by 2*cp_size=4"),
        ),
        BadInput(
            "cp-total-type",
            "CP",
            "total_tokens is not an int >= 0",
            part(cu, -8, 2, 0),
            _re("total_tokens=-8 must be an int >= 0"),
        ),
        BadInput(
            "cp-length-multiple",
            "CP",
            "a sequence's padded length is not a multiple of 2*cp_size",
            part(_t([0, 6, 8]), 8, 2, 0),
            _re(
                "sequence 0 has padded length 6 (cu_seqlens_padded), not a multiple of 2*cp_size=4"
            ),
        ),
        BadInput(
            "cp-first-boundary",
            "CP",
            "the boundaries do not start at 0",
            part(_t([4, 8]), 8, 2, 0),
            _re("cu_seqlens_padded[0] must be 0, got 4"),
        ),
        BadInput(
            "cp-decreasing",
            "CP",
            "the boundaries decrease",
            part(_t([0, 8, 4, 8]), 8, 2, 0),
            _re("cu_seqlens_padded must be non-decreasing: sequence 1 has length -4"),
        ),
        BadInput(
            "cp-short-cover",
            "CP",
            "the boundaries end before total_tokens",
            part(cu, 16, 2, 0),
            _re("cu_seqlens_padded ends at 8 but the global stream has 16 tokens"),
        ),
        BadInput(
            "cp-sentinel-order",
            "CP",
            "a boundary follows a (negative) sentinel",
            part(_t([0, 4, -1000, 8]), 8, 2, 0),
            _re(
                "cu_seqlens_padded has a non-negative entry 8 at index 3 after the sentinel at index 2"
            ),
        ),
        BadInput(
            "cp-only-sentinels",
            "CP",
            "the boundary array holds only sentinels",
            part(_t([-1000, -1000]), 8, 2, 0),
            _re("cu_seqlens_padded holds only sentinels"),
        ),
        BadInput(
            "cp-shard-extra-str",
            "CP",
            "shard_thd_batch_for_cp: extra_keys is a string",
            lambda _: cp.shard_thd_batch_for_cp(thd(), 2, 0, "labels"),
            _re("extra_keys='labels' must be a tuple of key names, e.g. ('labels',)"),
        ),
        BadInput(
            "cp-shard-no-tokens",
            "CP",
            "shard_thd_batch_for_cp: no input_ids",
            lambda _: cp.shard_thd_batch_for_cp(thd(input_ids=_DROP), 2, 0),
            _re("thd must hold the flattened token tensor 'input_ids'"),
        ),
        BadInput(
            "cp-shard-tokens-rank",
            "CP",
            "shard_thd_batch_for_cp: input_ids not [T] / [T, H] (a chunked batch)",
            lambda _: cp.shard_thd_batch_for_cp(thd(input_ids=torch.zeros(1, 8, 2)), 2, 0),
            _re("thd['input_ids'] must be [T] or [T, H], got shape (1, 8, 2)"),
        ),
        BadInput(
            "cp-shard-no-boundaries",
            "CP",
            "shard_thd_batch_for_cp: no boundaries",
            lambda _: cp.shard_thd_batch_for_cp(
                thd(cu_seqlens=_DROP, cu_seqlens_padded=_DROP), 2, 0
            ),
            _re("thd must hold 'cu_seqlens_padded' (or 'cu_seqlens') as a tensor"),
        ),
        BadInput(
            "cp-shard-token-key",
            "CP",
            "shard_thd_batch_for_cp: a per-token key is not [T, ...]",
            lambda _: cp.shard_thd_batch_for_cp(thd(hidden=torch.zeros(7, 2)), 2, 0, ("hidden",)),
            _re(
                "thd['hidden'] must be a [T, ...] tensor with T=8 (the length of input_ids), got (7, 2)"
            ),
        ),
        BadInput(
            "cp-shard-positions",
            "CP",
            "shard_thd_batch_for_cp: position_ids not [T] / [n_rope, 1, T]",
            lambda _: cp.shard_thd_batch_for_cp(thd(position_ids=torch.zeros(3, 2, 8)), 2, 0),
            _re("thd['position_ids'] must be [T] or [n_rope, 1, T] with T=8, got (3, 2, 8)"),
        ),
        BadInput(
            "cp-reorder-dim",
            "CP",
            "sequence_to_cp_rank_order: dim out of range",
            lambda _: cp.sequence_to_cp_rank_order(torch.zeros(8), cu, 2, dim=1),
            _re("dim=1 is out of range for x of shape (8,)"),
        ),
        BadInput(
            "cp-strategy",
            "CP",
            "strategy is not a CP load-balancing strategy",
            lambda _: cp.partition_indices(cu, 8, 2, 0, strategy="zigzag"),
            _re(
                "strategy='zigzag' is not a CP load-balancing strategy; use 'dual_chunk_swap' "
                "(the default), 'no_load_balance', or TE's CPLoadBalancingStrategy"
            ),
        ),
        BadInput(
            "cp-pieces",
            "CP",
            "no_load_balance: total_tokens is not a multiple of cp_size",
            lambda _: cp.partition_indices(_t([0, 5, 13]), 13, 4, 0, strategy="no_load_balance"),
            _re(
                "total_tokens=13 is not divisible by cp_size=4, which strategy='no_load_balance' cuts"
            ),
        ),
    ]


CASES.extend(_cp_rows())


# --------------------------------------------------------------------------- packing


def _packing_rows() -> list[BadInput]:
    import torch

    from te_thd import packing as pk

    ids = torch.arange(1, 4)

    def coll(*a: Any, **kw: Any) -> Callable[[Path], Any]:
        return lambda _: pk.PackingCollator(*a, **kw)

    def pack(samples: Any, seq_len: int = 8, **kw: Any) -> Callable[[Path], Any]:
        return lambda _: pk.PackingCollator(seq_len, **kw)(samples)

    def plan(*a: Any, **kw: Any) -> Callable[[Path], Any]:
        return lambda _: pk.plan_global_batch(*a, **kw)

    return [
        BadInput(
            "pack-seq-len",
            "packing",
            "seq_len is not an int >= 1",
            coll(0),
            _re("seq_len=0 must be an int >= 1"),
        ),
        BadInput(
            "pack-multiple",
            "packing",
            "pad_to_multiple_of is not an int >= 1",
            coll(8, pad_to_multiple_of=0),
            _re("pad_to_multiple_of=0 must be an int >= 1"),
        ),
        BadInput(
            "pack-seq-len-multiple",
            "packing",
            "seq_len is not a multiple of pad_to_multiple_of",
            coll(10, pad_to_multiple_of=4),
            _re("seq_len=10 must be a multiple of pad_to_multiple_of=4")
            + ".*"
            + _re("use seq_len=12"),
        ),
        BadInput(
            "pack-overlong-mode",
            "packing",
            "overlong is neither 'truncate' nor 'raise'",
            coll(8, overlong="wrap"),
            _re("overlong must be 'truncate' or 'raise', got 'wrap'"),
        ),
        BadInput(
            "pack-sentinel",
            "packing",
            "seq_lens_padding_value is not a negative int",
            coll(8, seq_lens_padding_value=0),
            _re(
                "seq_lens_padding_value must be a negative int (a length can never equal it), got 0"
            ),
        ),
        BadInput(
            "pack-rows",
            "packing",
            "rows is not None or an int >= 1",
            coll(8, rows=0),
            _re("rows=0 must be an int >= 1"),
        ),
        BadInput(
            "pack-bin-packing",
            "packing",
            "bin_packing is neither 'ffd' nor 'first_fit'",
            coll(8, bin_packing="best"),
            _re("bin_packing must be 'ffd' or 'first_fit', got 'best'"),
        ),
        BadInput("pack-no-samples", "packing", "no samples", pack([]), _re("samples is empty")),
        BadInput(
            "pack-no-input",
            "packing",
            "sample 0 lacks the input key",
            pack([{"tokens": ids}]),
            _re("sample 0 must be a dict holding 'input_ids', got ['tokens']"),
        ),
        BadInput(
            "pack-keys-differ",
            "packing",
            "samples carry different keys",
            pack([{"input_ids": ids}, {"input_ids": ids, "labels": ids}]),
            _re("sample 1 has keys ['input_ids', 'labels'], sample 0 has ['input_ids']"),
        ),
        BadInput(
            "pack-input-rank",
            "packing",
            "a sample's input is not 1-D",
            pack([{"input_ids": ids.reshape(1, 3)}]),
            _re("sample 0['input_ids'] must be a 1-D tensor, got (1, 3)"),
        ),
        BadInput(
            "pack-empty-sample",
            "packing",
            "a sample has 0 tokens",
            pack([{"input_ids": ids[:0]}]),
            _re("sample 0 is empty (0 tokens); drop empty documents before packing"),
        ),
        BadInput(
            "pack-key-length",
            "packing",
            "a per-token key's length differs from the sample's",
            pack([{"input_ids": ids, "labels": ids[:2]}]),
            _re("sample 0['labels'] must be a 1-D tensor of the sample's length 3, got (2,)"),
        ),
        BadInput(
            "pack-key-collision",
            "packing",
            "a sample key named like a collator output (e.g. 'input_ids' beside input_key='tokens')",
            lambda _: pk.PackingCollator(8, input_key="tokens")(
                [{"tokens": ids, "input_ids": ids}]
            ),
            _re(
                "sample key 'input_ids' collides with the collator's output 'input_ids' (input_key='tokens'"
            ),
        ),
        BadInput(
            "pack-overlong",
            "packing",
            "a sample is longer than seq_len (overlong='raise')",
            pack([{"input_ids": torch.arange(9)}]),
            _re(
                "sample 0 has 9 tokens > seq_len=8; pass overlong='truncate' to cut it, or raise seq_len"
            ),
        ),
        BadInput(
            "pack-rows-too-few",
            "packing",
            "the samples need more rows than rows=",
            pack([{"input_ids": torch.arange(6)}, {"input_ids": torch.arange(6)}], rows=1),
            _re("the 2 samples need 2 rows of seq_len=8 but rows=1"),
        ),
        BadInput(
            "pack-multiple-for",
            "packing",
            "pad_to_multiple_for: cp_size / tp_size not an int >= 1",
            lambda _: pk.pad_to_multiple_for(0),
            _re("cp_size=0 must be an int >= 1"),
        ),
        BadInput(
            "pack-bins-negative",
            "packing",
            "assign_bins: a negative length",
            lambda _: pk.assign_bins([3, -1], 8),
            _re("lengths must be >= 0: item 1 has length -1"),
        ),
        BadInput(
            "pack-bins-capacity",
            "packing",
            "assign_bins: an item larger than the capacity",
            lambda _: pk.assign_bins([9, 1], 8),
            _re("item 0 has length 9 > capacity=8; it cannot fit any bin"),
        ),
        BadInput(
            "pack-flat-rank",
            "packing",
            "flattened batch: position_ids not [T] / [B, T]",
            lambda _: pk.seq_lens_from_position_ids(torch.zeros(1, 1, 4, dtype=torch.long)),
            _re("position_ids must be a [T] or [B, T] tensor, got (1, 1, 4)"),
        ),
        BadInput(
            "pack-flat-dtype",
            "packing",
            "flattened batch: position_ids not integer",
            lambda _: pk.seq_lens_from_position_ids(torch.zeros(4)),
            _re("position_ids must have an integer dtype, got torch.float32"),
        ),
        BadInput(
            "pack-flat-start",
            "packing",
            "flattened batch: the stream does not start at 0",
            lambda _: pk.seq_lens_from_position_ids(_t([1, 2, 0])),
            _re("position_ids must start a document with 0 at index 0, got 1"),
        ),
        BadInput(
            "pack-flat-row-start",
            "packing",
            "flattened batch: a row does not start at 0",
            lambda _: pk.seq_lens_from_position_ids(_t([[0, 1, 2], [3, 4, 5]])),
            _re("position_ids row 1 starts at 3, not 0"),
        ),
        BadInput(
            "pack-flat-step",
            "packing",
            "flattened batch: a position id is neither 0 nor its predecessor + 1",
            lambda _: pk.seq_lens_from_position_ids(_t([0, 1, 5, 0])),
            _re("position_ids[2]=5 follows 1: within a document position ids must count up by 1"),
        ),
        BadInput(
            "pack-flat-mapping",
            "packing",
            "flattened batch without position_ids",
            lambda _: pk.unflatten_from_position_ids({"input_ids": ids}),
            _re("a flattened batch must be a mapping holding 'position_ids'"),
        ),
        BadInput(
            "plan-overlong",
            "packing",
            "plan_global_batch: a length above seq_len once padded",
            plan([3, 9], 2, 10, pad_to_multiple_of=4),
            _re(
                "lengths[1]=9 (padded to 12 with pad_to_multiple_of=4) > seq_len=10: a document must fit one row"
            ),
        ),
        BadInput(
            "plan-replicas",
            "packing",
            "plan_global_batch: num_replicas < 1",
            plan([3], 0, 8),
            _re("num_replicas=0 must be an int >= 1"),
        ),
        BadInput(
            "plan-empty-document",
            "packing",
            "plan_global_batch: a length < 1",
            plan([3, 0], 1, 8),
            _re("lengths[1]=0: every document needs at least one token; drop empty documents"),
        ),
        BadInput(
            "plan-lengths-rank",
            "packing",
            "plan_global_batch: lengths not 1-D",
            plan([[3, 4]], 1, 8),
            _re("lengths must be 1-D (one length per document), got shape (1, 2)"),
        ),
        BadInput(
            "plan-lengths-dtype",
            "packing",
            "plan_global_batch: lengths not integers",
            plan([2.5], 1, 8),
            _re("lengths must be integers, got dtype float64"),
        ),
        BadInput(
            "plan-attn-scale",
            "packing",
            "plan_global_batch: attn_scale not > 0",
            plan([3], 1, 8, attn_scale=-1.0),
            _re("attn_scale=-1.0 must be > 0"),
        ),
        BadInput(
            "plan-rows-below-bound",
            "packing",
            "plan_global_batch: rows_per_replica below the lower bound",
            plan([6, 6, 6], 1, 8, rows_per_replica=2),
            _re("rows_per_replica=2 is too small")
            + ".*"
            + _re(
                "need at least 3 rows of seq_len=8 per replica; pass rows_per_replica>=3 or None"
            ),
        ),
        BadInput(
            "plan-rows-unpackable",
            "packing",
            "plan_global_batch: rows_per_replica at the bound but too few to pack",
            plan([4, 4, 4, 4, 4], 1, 10, rows_per_replica=2),
            _re("rows_per_replica=2 cannot hold this global batch")
            + ".*"
            + _re(
                "needs 3 rows of seq_len=10 per replica (the lower bound is 2); pass rows_per_replica>=3 or None"
            ),
        ),
        BadInput(
            "pack-plan-counts",
            "packing",
            "PackingCollator(samples, rows=): row counts do not add up to the samples",
            lambda _: pk.PackingCollator(8)([{"input_ids": ids}, {"input_ids": ids}], rows=[1, 2]),
            _re(
                "rows=[1, 2] must be >= 0 sample counts, one per row, summing to the 2 samples given"
            ),
        ),
        BadInput(
            "pack-plan-overflow",
            "packing",
            "PackingCollator(samples, rows=): a planned row overflows seq_len",
            lambda _: pk.PackingCollator(8)(
                [{"input_ids": ids}, {"input_ids": torch.arange(6)}], rows=[2]
            ),
            _re(
                "planned row 0 holds 9 padded tokens > seq_len=8; plan with the collator's seq_len"
            ),
        ),
    ]


CASES.extend(_packing_rows())


# ------------------------------------------------------------------------- attention


def _attention_rows() -> list[BadInput]:
    import torch

    from te_thd import attention as at
    from te_thd.thd_utils import process_input_for_thd

    def example() -> dict[str, Any]:
        return dict(process_input_for_thd(_thd_batch()))  # pad_between_seqs True

    def absorbed() -> dict[str, Any]:
        return dict(
            process_input_for_thd(
                _thd_batch(
                    seq_lens=_t([[4, 2], [3, -1000]]), seq_lens_padded=_t([[4, 2], [3, -1000]])
                )
            )
        )

    def kwargs(
        thd: Callable[[], dict[str, Any]], mask: str = "padding_causal", **kw: Any
    ) -> Callable[[Path], Any]:
        return lambda _: at.te_attention_kwargs(thd(), mask, **kw)

    def replaced(**over: Any) -> Callable[[], dict[str, Any]]:
        def make() -> dict[str, Any]:
            d = example()
            for k, v in over.items():
                if v is _DROP:
                    d.pop(k)
                else:
                    d[k] = v
            return d

        return make

    i32 = torch.int32
    cu = _t([0, 3, 5, 11], dtype=i32)
    cup = _t([0, 4, 6, 12], dtype=i32)
    q = torch.zeros(12, 2, 8)

    def contract(query: Any = q, key: Any = q, value: Any = q, **kw: Any) -> Callable[[Path], Any]:
        args = {
            "cu_seqlens_q": cu,
            "cu_seqlens_kv": cu,
            "cu_seqlens_q_padded": cup,
            "cu_seqlens_kv_padded": cup,
            "max_seqlen_q": 6,
            "max_seqlen_kv": 6,
            "pad_between_seqs": True,
        }
        args.update(kw)
        return lambda _: at.check_te_thd_args(query, key, value, **args)

    return [
        BadInput(
            "attn-thd-type",
            "attention",
            "te_attention_kwargs: the batch is not a dict",
            lambda _: at.te_attention_kwargs([1]),
            _re(
                "thd must be the dict returned by te_thd.thd_utils.process_input_for_thd, got list"
            ),
        ),
        BadInput(
            "attn-no-cu",
            "attention",
            "te_attention_kwargs: no cu_seqlens",
            kwargs(replaced(cu_seqlens=_DROP)),
            _re("thd['cu_seqlens'] is missing or not a tensor"),
        ),
        BadInput(
            "attn-cup-type",
            "attention",
            "te_attention_kwargs: cu_seqlens_padded is not a tensor",
            kwargs(replaced(cu_seqlens_padded=[0, 4])),
            _re("thd['cu_seqlens_padded'] must be a tensor or absent, got list"),
        ),
        BadInput(
            "attn-cp-size",
            "attention",
            "te_attention_kwargs: cp_size is not an int >= 1",
            kwargs(example, cp_size=0),
            _re("cp_size=0 must be an int >= 1"),
        ),
        BadInput(
            "attn-pad-flag-type",
            "attention",
            "te_attention_kwargs: pad_between_seqs is not a Python bool",
            kwargs(replaced(pad_between_seqs=torch.tensor(True))),
            _re("thd['pad_between_seqs'] must be a Python bool, got Tensor"),
        ),
        BadInput(
            "attn-max-seqlen",
            "attention",
            "te_attention_kwargs: max_seqlen is not a non-negative int",
            kwargs(example, max_seqlen=-1),
            _re("max_seqlen=-1 must be an int >= 0"),
        ),
        BadInput(
            "attn-bidirectional-absorbed",
            "attention",
            "bidirectional mask over a batch whose trailing pad was absorbed (causal-only layout)",
            kwargs(absorbed, "padding"),
            _re(
                "bidirectional attention over a batch whose trailing padding was absorbed into the last sequence"
            )
            + ".*"
            + _re("absorb_trailing_pad=False"),
        ),
        BadInput(
            "attn-mask-type",
            "attention",
            "attn_mask_type is not a string",
            kwargs(example, 3),
            _re("attn_mask_type must be a string such as 'padding_causal', got 3"),
        ),
        BadInput(
            "attn-mask-unknown",
            "attention",
            "attn_mask_type is not a TE mask type",
            kwargs(example, "sliding"),
            _re("attn_mask_type='sliding' is not supported"),
        ),
        BadInput(
            "attn-mask-no-padding",
            "attention",
            "attn_mask_type without padding (TE's THD needs it)",
            kwargs(example, "causal"),
            _re("attn_mask_type='causal' has no padding mask"),
        ),
        BadInput(
            "attn-pad-flag-false",
            "attention",
            "pad_between_seqs=False while the boundary arrays differ (NVIDIA/TransformerEngine#3331)",
            kwargs(replaced(pad_between_seqs=False)),
            _re("pad_between_seqs=False but cu_seqlens [0, 3, 5, 11] differs"),
        ),
        BadInput(
            "attn-max-seqlen-small",
            "attention",
            "max_seqlen below the longest sequence",
            kwargs(example, max_seqlen=2),
            _re("max_seqlen=2 is smaller than sequence"),
        ),
        BadInput(
            "attn-cp-multiple",
            "attention",
            "te_attention_kwargs(cp_size=2): a padded length not a multiple of 4",
            kwargs(example, cp_size=2),
            _re("not a multiple of 2*cp_size=4"),
        ),
        BadInput(
            "attn-qkv-rank",
            "attention",
            "check_te_thd_args: q/k/v not 3-D [T, H, D]",
            contract(query=torch.zeros(12, 16)),
            _re("query must be a 3-D [T, H, D] tensor when qkv_format='thd'"),
        ),
        BadInput(
            "attn-qkv-dtype",
            "attention",
            "check_te_thd_args: q/k/v dtypes differ",
            contract(key=q.double()),
            _re("query, key and value must share a dtype"),
        ),
        BadInput(
            "attn-kv-tokens",
            "attention",
            "check_te_thd_args: key and value disagree in tokens or heads",
            contract(value=torch.zeros(11, 2, 8)),
            r"key \(12, 2, 8\) and value \(11, 2, 8\) must agree in tokens",
        ),
        BadInput(
            "attn-head-dim",
            "attention",
            "check_te_thd_args: query and key head_dim differ",
            contract(key=torch.zeros(12, 2, 4), value=torch.zeros(12, 2, 4)),
            _re("query head_dim 8 != key head_dim 4"),
        ),
        BadInput(
            "attn-gqa",
            "attention",
            "check_te_thd_args: query heads not a multiple of key/value heads",
            contract(query=torch.zeros(12, 3, 8)),
            _re("query has 3 heads, not a multiple of key/value's 2"),
        ),
        BadInput(
            "attn-cp-odd-local",
            "attention",
            "check_te_thd_args: odd local token count under CP",
            contract(
                query=torch.zeros(3, 2, 8),
                key=torch.zeros(3, 2, 8),
                value=torch.zeros(3, 2, 8),
                cp_size=2,
            ),
            _re("must be even under context parallelism (cp_size=2"),
        ),
        BadInput(
            "attn-format",
            "attention",
            "qkv_format is not 'thd'",
            contract(qkv_format="bshd"),
            _re("qkv_format must be 'thd' for packed sequences, got 'bshd'"),
        ),
        BadInput(
            "attn-cu-none",
            "attention",
            "cu_seqlens_q missing",
            contract(cu_seqlens_q=None),
            _re("cu_seqlens_q must be an int32 [N+1] tensor when qkv_format='thd', got NoneType"),
        ),
        BadInput(
            "attn-cu-dtype",
            "attention",
            "boundaries not int32",
            contract(cu_seqlens_q=cu.long()),
            _re("cu_seqlens_q must have dtype torch.int32, got torch.int64"),
        ),
        BadInput(
            "attn-cu-rank",
            "attention",
            "boundaries not 1-D",
            contract(cu_seqlens_q=cu.reshape(1, 4)),
            _re("cu_seqlens_q must be 1-D [N+1], got shape (1, 4)"),
        ),
        BadInput(
            "attn-cu-shapes",
            "attention",
            "q and kv boundary arrays differ in shape",
            contract(cu_seqlens_kv=_t([0, 11], dtype=i32)),
            _re("cu_seqlens_kv has shape (2,) but cu_seqlens_q has shape (4,)"),
        ),
        BadInput(
            "attn-max-seqlen-tensor",
            "attention",
            "max_seqlen passed as a tensor (TE would sync)",
            contract(max_seqlen_q=torch.tensor(6)),
            _re(
                "max_seqlen_q=tensor(6) must be an int (a Python int: a tensor makes TE sync the device"
            ),
        ),
        BadInput(
            "attn-cu-start",
            "attention",
            "boundaries do not start at 0",
            contract(
                cu_seqlens_q=_t([1, 3, 5, 11], dtype=i32),
                cu_seqlens_kv=_t([1, 3, 5, 11], dtype=i32),
            ),
            _re("cu_seqlens_q[0] must be 0, got 1"),
        ),
        BadInput(
            "attn-cu-monotone",
            "attention",
            "boundaries decrease",
            contract(
                cu_seqlens_q=_t([0, 3, 2, 11], dtype=i32),
                cu_seqlens_kv=_t([0, 3, 2, 11], dtype=i32),
            ),
            _re("cu_seqlens_q must be non-decreasing: sequence 1 has length -1"),
        ),
        BadInput(
            "attn-real-gt-padded",
            "attention",
            "a real segment longer than its padded slot",
            contract(
                cu_seqlens_q=_t([0, 5, 6, 12], dtype=i32),
                cu_seqlens_kv=_t([0, 5, 6, 12], dtype=i32),
            ),
            _re(
                "sequence 0 has real length 5 (cu_seqlens_q) but only 4 slots (cu_seqlens_q_padded)"
            ),
        ),
        BadInput(
            "attn-padded-beyond",
            "attention",
            "padded boundaries beyond the token stream",
            contract(
                query=torch.zeros(8, 2, 8), key=torch.zeros(8, 2, 8), value=torch.zeros(8, 2, 8)
            ),
            _re("cu_seqlens_q_padded ends at 12, beyond the 8 tokens of the global stream"),
        ),
        BadInput(
            "attn-cp-needs-padded",
            "attention",
            "CP without cu_seqlens_*_padded",
            contract(
                query=torch.zeros(6, 2, 8),
                key=torch.zeros(6, 2, 8),
                value=torch.zeros(6, 2, 8),
                cu_seqlens_q_padded=None,
                cu_seqlens_kv_padded=None,
                cp_size=2,
            ),
            _re("cu_seqlens_q_padded is required with context parallelism (cp_size=2)"),
        ),
        BadInput(
            "attn-cp-mask",
            "attention",
            "a mask type TE's THD CP does not support",
            contract(attn_mask_type="padding_causal_bottom_right", cp_size=2),
            _re(
                "attn_mask_type='padding_causal_bottom_right' with context parallelism (cp_size=2)"
            ),
        ),
        BadInput(
            "attn-cp-cover",
            "attention",
            "under CP the padded boundaries do not cover the global stream",
            contract(
                query=torch.zeros(8, 2, 8),
                key=torch.zeros(8, 2, 8),
                value=torch.zeros(8, 2, 8),
                cu_seqlens_q=_t([0, 3, 5, 7], dtype=i32),
                cu_seqlens_kv=_t([0, 3, 5, 7], dtype=i32),
                cu_seqlens_q_padded=_t([0, 4, 8, 12], dtype=i32),
                cu_seqlens_kv_padded=_t([0, 4, 8, 12], dtype=i32),
                cp_size=2,
            ),
            _re("cu_seqlens_q_padded ends at 12 but the global stream has 16 tokens"),
        ),
        BadInput(
            "attn-varlen-padding",
            "attention",
            "flash-attn / torch varlen kwargs, bidirectional, with padding between sequences",
            lambda _: at.flash_attn_varlen_kwargs(example(), causal=False),
            _re("cannot express padding between sequences for bidirectional attention"),
        ),
        BadInput(
            "attn-varlen-cp",
            "attention",
            "varlen kwargs for a CP-sharded batch",
            lambda _: at.torch_varlen_kwargs(
                {
                    "cu_seqlens": _t([0, 4, 8], dtype=i32),
                    "pad_between_seqs": False,
                    "input_ids": torch.arange(4),
                    "cp_size": 2,
                }
            ),
            _re("has no context parallelism, but thd is sharded for cp_size=2"),
        ),
        BadInput(
            "attn-module-backend",
            "attention",
            "ThdAttention: unknown backend",
            lambda _: at.ThdAttention(2, 8, backend="cuda"),
            _re("backend must be 'auto', 'te' or 'reference', got 'cuda'"),
        ),
        BadInput(
            "attn-module-heads",
            "attention",
            "ThdAttention: heads not a multiple of num_gqa_groups",
            lambda _: at.ThdAttention(3, 8, num_gqa_groups=2),
            _re("num_attention_heads=3 must be a positive multiple of num_gqa_groups=2"),
        ),
        BadInput(
            "attn-module-forward",
            "attention",
            "ThdAttention.forward: neither a THD batch nor TE kwargs",
            lambda _: at.ThdAttention(2, 8, backend="reference")(q, q, q, {"input_ids": q}),
            _re("thd has neither 'cu_seqlens' (a THD batch) nor 'cu_seqlens_q' (TE kwargs)"),
        ),
        BadInput(
            "attn-module-comm-type",
            "attention",
            "ThdAttention: a cp_comm_type TE does not have",
            lambda _: at.ThdAttention(2, 8, cp_comm_type="ring"),
            _re("cp_comm_type='ring' is not one of TE's ('p2p', 'all_gather', 'a2a', 'a2a+p2p')"),
        ),
        BadInput(
            "attn-module-comm-group",
            "attention",
            "ThdAttention: a list of groups for a flat cp_comm_type",
            lambda _: at.ThdAttention(2, 8, cp_group=[None, None], cp_comm_type="p2p"),
            _re(
                "cp_comm_type='p2p' needs one torch.distributed ProcessGroup as cp_group, got list"
            ),
        ),
        BadInput(
            "attn-module-comm-hier",
            "attention",
            "ThdAttention: a2a+p2p without [a2a_group, p2p_group]",
            lambda _: at.ThdAttention(2, 8, cp_group=object(), cp_comm_type="a2a+p2p"),
            _re("cp_comm_type='a2a+p2p' needs cp_group=[a2a_group, p2p_group]"),
        ),
        BadInput(
            "attn-fixed-too-many",
            "attention",
            "fixed shapes: more sequences than max_num_seqs",
            kwargs(example, max_num_seqs=1),
            _re(
                "the batch has 3 sequences, more than max_num_seqs=1: its boundary arrays cannot be padded"
            ),
        ),
        BadInput(
            "attn-fixed-bound",
            "attention",
            "fixed shapes: a max_seqlen bound below the longest sequence",
            kwargs(example, max_num_seqs=8, max_seqlen=2),
            _re("max_seqlen=2 is below the batch's longest sequence (6 slots"),
        ),
        BadInput(
            "attn-fixed-count",
            "attention",
            "fixed shapes: max_num_seqs < 1",
            kwargs(example, max_num_seqs=0),
            _re("max_num_seqs=0 must be an int >= 1"),
        ),
        BadInput(
            "attn-strategy-mask",
            "attention",
            "no_load_balance under CP with a bidirectional mask",
            lambda _: at.te_attention_kwargs(
                {**example(), "cp_size": 2, "input_ids": torch.zeros(6)},
                "padding",
                strategy="no_load_balance",
            ),
            _re("attn_mask_type='padding' with strategy='no_load_balance' (cp_size=2): TE asserts"),
            exc=at.ThdContractError,
        ),
        BadInput(
            "attn-strategy-te",
            "attention",
            "a CP strategy the installed TE (or no TE) lacks",
            lambda _: at.te_cp_group_kwargs("no_load_balance"),
            _re(
                "strategy='no_load_balance' needs Transformer Engine's "
                "transformer_engine.pytorch.constants.CPLoadBalancingStrategy with that member"
            ),
        ),
        BadInput(
            "attn-pitfalls-version",
            "attention",
            "check_te_thd_kwargs: te_version is not a version",
            lambda _: at.check_te_thd_kwargs({}, te_version="two"),
            _re("te_version='two' is not a TE version; pass a string such as '2.18.0'"),
        ),
        BadInput(
            "attn-pitfalls-kwargs",
            "attention",
            "check_te_thd_kwargs: kwargs is not a mapping",
            lambda _: at.check_te_thd_kwargs([]),
            _re("kwargs must be the dict of TE THD kwargs"),
        ),
        BadInput(
            "attn-pitfalls-head-dim",
            "attention",
            "check_te_thd_kwargs: head_dim is not a positive int",
            lambda _: at.check_te_thd_kwargs({"pad_between_seqs": True}, head_dim=0),
            _re("head_dim=0 must be a positive int"),
        ),
        BadInput(
            "cache-thd-collate-strategy",
            "cache",
            "CachedThdCollator: no_load_balance with seq_len not a multiple of cp_size",
            lambda _: __import__("te_thd.offline_cache", fromlist=["x"]).CachedThdCollator(
                50, cp_size=4, strategy="no_load_balance"
            ),
            _re("seq_len=50 must be a multiple of cp_size=4 with strategy='no_load_balance'"),
        ),
    ]


CASES.extend(_attention_rows())


# ----------------------------------------------------------------------------- cache

_CLEAN_CACHE: list[Path] = []


def _compute(batch: Any) -> dict[str, Any]:
    import torch

    idx = batch["idx"]
    return {
        "hidden": idx[:, None].float() * torch.ones(1, 4),
        "input_ids": idx[:, None] * 10 + torch.arange(3),
    }


def _compute_n(batch: Any) -> dict[str, Any]:
    """:func:`_compute` plus each sample's length ``n`` (2 of its 3 tokens)."""
    import torch

    return {**_compute(batch), "n": torch.full((len(batch["idx"]),), 2)}


def _produce(out: Path, n: int = 6, shard_size: int = 2, **kw: Any) -> Any:
    from torch.utils.data import DataLoader

    from te_thd.offline_cache import produce_cache

    kw.setdefault("keys", ("hidden", "input_ids"))
    kw.setdefault("options", {"cp_size": 2})
    loader = kw.pop("loader", None)
    if loader is None:
        loader = DataLoader(IndexDataset(n), batch_size=2)
    return produce_cache(
        loader, str(out), shard_size, kw.pop("compute", _compute), progress=False, **kw
    )


def _cache(tmp: Path) -> Path:
    """A finished 6-sample, 3-shard cache copied into ``tmp / "cache"``."""
    import shutil
    import tempfile

    if not _CLEAN_CACHE:
        d = Path(tempfile.mkdtemp(prefix="te_thd_catalogue_")) / "cache"
        _produce(d)
        _CLEAN_CACHE.append(d)
    dst = tmp / "cache"
    shutil.copytree(_CLEAN_CACHE[0], dst)
    return dst


def _rewrite_manifest(d: Path, fn: Callable[[dict[str, Any]], Any]) -> Path:
    """Edit ``d/manifest.json`` as a user (or a bug) would; the manifest's own checksum, when
    it records one, is recomputed so the edit reaches the check it targets."""
    import json

    from te_thd.offline_cache.record import manifest as fmt

    m = json.loads((d / "manifest.json").read_text())
    fn(m)
    key = getattr(fmt, "MANIFEST_CHECKSUM_KEY", None)
    if key is not None and key in m:
        m[key] = fmt.manifest_checksum(m)
    (d / "manifest.json").write_text(json.dumps(m))
    return d


def _edit_manifest(tmp: Path, fn: Callable[[dict[str, Any]], Any]) -> Path:
    """A fresh cache copy in ``tmp`` with its manifest edited by ``fn``."""
    return _rewrite_manifest(_cache(tmp), fn)


def _replace_in(path: Path, old: str, new: str) -> Path:
    """Replace ``old`` by ``new`` in a file (a byte-level edit: no checksum is recomputed)."""
    text = path.read_text()
    assert old in text, (old, path)
    path.write_text(text.replace(old, new, 1))
    return path.parent


def _open(d: Path, keys: Any = ("hidden", "input_ids"), **kw: Any) -> Any:
    from te_thd.offline_cache import CachedTensorDataset

    return CachedTensorDataset(str(d), "offline", 1, keys, **kw)


def _cache_rows() -> list[BadInput]:
    import torch

    from te_thd import offline_cache as oc

    def opened(prepare: Callable[[Path], Path], **kw: Any) -> Callable[[Path], Any]:
        return lambda tmp: _open(prepare(tmp), **kw)

    def deep(prepare: Callable[[Path], Path]) -> Callable[[Path], Any]:
        return lambda tmp: oc.verify_cache(str(prepare(tmp)), deep=True)

    def write_text(name: str, text: str) -> Callable[[Path], Path]:
        def prep(tmp: Path) -> Path:
            d = _cache(tmp)
            (d / name).write_text(text)
            return d

        return prep

    def unlink(name: str) -> Callable[[Path], Path]:
        def prep(tmp: Path) -> Path:
            d = _cache(tmp)
            (d / name).unlink()
            return d

        return prep

    def copy_shard(src: str, dst: str) -> Callable[[Path], Path]:
        def prep(tmp: Path) -> Path:
            d = _cache(tmp)
            (d / dst).write_bytes((d / src).read_bytes())
            return d

        return prep

    def truncate(tmp: Path) -> Path:
        d = _cache(tmp)
        p = d / "shard-000001.safetensors"
        p.write_bytes(p.read_bytes()[:-5])
        return d

    def flip_data(tmp: Path) -> Path:
        d = _cache(tmp)
        p = d / "shard-000001.safetensors"
        data = bytearray(p.read_bytes())
        data[-1] ^= 0xFF
        p.write_bytes(bytes(data))
        return d

    def swap_dtype(tmp: Path) -> Path:
        d = _cache(tmp)
        p = d / "shard-000001.safetensors"
        p.write_bytes(p.read_bytes().replace(b'"I64"', b'"F64"', 1))
        return d

    def rename_metadata(tmp: Path) -> Path:
        d = _cache(tmp)  # one flipped bit in "__metadata__": the metadata reads as a tensor entry
        p = d / "shard-000001.safetensors"
        p.write_bytes(p.read_bytes().replace(b'"__metadata__"', b'"__metadatb__"', 1))
        return d

    def swap_in_other_shard(tmp: Path) -> Path:
        d = _cache(
            tmp
        )  # shard 2 is sound and as large as shard 1: only the manifest tells them apart
        (d / "shard-000001.safetensors").write_bytes((d / "shard-000002.safetensors").read_bytes())
        return d

    def rewrite_shard(tensors: dict[str, Any]) -> Callable[[Path], Path]:
        def prep(tmp: Path) -> Path:
            from safetensors.torch import save_file

            d = _cache(tmp)
            p = d / "shard-000001.safetensors"
            save_file(tensors, str(p))
            size = p.stat().st_size
            return _rewrite_manifest(d, lambda m: m["shards"][1].__setitem__("bytes", size))

        return prep

    def garble_header(tmp: Path) -> Path:
        d = _cache(tmp)
        p = d / "shard-000001.safetensors"
        data = bytearray(p.read_bytes())
        data[9] = 0x01
        p.write_bytes(bytes(data))
        return d

    def set_key(key: str, value: Any) -> Callable[[Path], Path]:
        def prep(tmp: Path) -> Path:
            return _edit_manifest(tmp, lambda m: m.__setitem__(key, value))

        return prep

    def drop_key(key: str) -> Callable[[Path], Path]:
        return lambda tmp: _edit_manifest(tmp, lambda m: m.pop(key))

    def produce_into(prepare: Callable[[Path], Path], **kw: Any) -> Callable[[Path], Any]:
        return lambda tmp: _produce(prepare(tmp), **kw)

    def fresh(tmp: Path) -> Path:
        return tmp / "out"

    def piece_rows(tmp: Path) -> None:
        with oc.DurableShardWriter(("hidden",)) as w:
            w.write_piece(str(tmp), 0, 0, {"hidden": torch.zeros(2, 4)})

    def unfinished(tmp: Path) -> Path:
        d = _cache(tmp)
        (d / "manifest.json").unlink()
        (d / ".te_thd-producer.json").write_text(
            '{"format_version": 1, "keys": ["hidden", "input_ids"], "num_samples": 6, '
            '"options": {"cp_size": 2}, "shard_size": 2}\n'
        )
        return d

    def orphan_shards(tmp: Path) -> Path:
        d = _cache(tmp)
        (d / "manifest.json").unlink()
        return d

    def foreign(tmp: Path) -> Path:
        (tmp / "out").mkdir()
        (tmp / "out" / "notes.txt").write_text("mine")
        return tmp / "out"

    def repair_held(tmp: Path) -> Any:
        d = _cache(tmp)
        lock = oc.ProducerLock(str(d)).acquire()  # this process: a live producer
        try:
            oc.repair_cache(str(d))
        finally:
            lock.release()

    def held(tmp: Path) -> Any:
        d = _cache(tmp)
        lock = oc.ProducerLock(str(d)).acquire()
        try:
            oc.ProducerLock(str(d)).acquire()
        finally:
            lock.release()

    def options_mismatch(tmp: Path) -> Any:
        d = _cache(tmp)
        m = oc.read_manifest(str(d), "offline", 1)
        oc.ensure_supervision_options_match(m, {"cp_size": 4}, "offline", str(d), "produce_cache")

    def options_missing(tmp: Path) -> Any:
        d = _cache(tmp)
        m = oc.read_manifest(str(d), "offline", 1)
        oc.ensure_supervision_options_match(
            m, {"mask_generation_prompt": True}, "offline", str(d), "produce_cache"
        )

    class _Iterable(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield {"idx": 0}

    def sampler(**kw: Any) -> Callable[[Path], Any]:
        return lambda tmp: oc.CacheShardSampler(_open(_cache(tmp)), **kw)

    def loader(**kw: Any) -> Callable[[Path], Any]:
        def run(tmp: Path) -> Any:
            ds = _open(_cache(tmp))
            args = {"batch_size": 2, "shuffle": False, "collate_fn": lambda b: b}
            args.update(kw)
            return oc.build_cached_dataloader(ds, **args)

        return run

    return [
        # -- manifest / format (read at open) --
        BadInput(
            "cache-no-manifest",
            "cache",
            "no manifest.json (the producer never finished)",
            opened(unlink("manifest.json")),
            _re("offline cache manifest not found at <dir>/cache/manifest.json"),
            exc=oc.ManifestNotFoundError,
        ),
        BadInput(
            "cache-manifest-json",
            "cache",
            "manifest.json is not JSON (e.g. truncated)",
            opened(write_text("manifest.json", '{"num_samples": 6, "sha')),
            _re("offline cache manifest <dir>/cache/manifest.json is not valid JSON"),
        ),
        BadInput(
            "cache-manifest-empty",
            "cache",
            "manifest.json is empty (cut off, e.g. by a full disk)",
            opened(write_text("manifest.json", "")),
            _re(
                "offline cache manifest <dir>/cache/manifest.json is empty (0 bytes): it was cut off after it was "
                "written (a full disk, a copy that stopped). Restore manifest.json from a copy, or rebuild it "
                "from the shards: `te-thd cache repair <dir>/cache`"
            ),
        ),
        BadInput(
            "cache-no-manifest-stopped",
            "cache",
            "no manifest.json: its producer run is unfinished (stopped, or reopened by repair)",
            opened(unfinished),
            _re(
                "offline cache manifest not found at <dir>/cache/manifest.json (3 shard(s) so far): its producer "
                "run is unfinished (stopped by an error, or reopened by te-thd cache repair); resume with: the "
                "`te_thd.offline_cache.produce_cache(...)` call"
            ),
            exc=oc.ManifestNotFoundError,
        ),
        BadInput(
            "cache-manifest-object",
            "cache",
            "manifest.json is JSON but not an object",
            opened(write_text("manifest.json", "[1, 2]")),
            _re("holds a JSON list, not an object"),
        ),
        BadInput(
            "cache-manifest-checksum",
            "cache",
            "manifest.json edited or damaged after it was written (own checksum)",
            opened(
                lambda tmp: _replace_in(
                    _cache(tmp) / "manifest.json", '"cp_size": 2', '"cp_size": 3'
                )
            ),
            _re(
                "offline cache manifest <dir>/cache/manifest.json does not match its own checksum (it records crc32:"
            ),
        ),
        BadInput(
            "cache-format-version",
            "cache",
            "the manifest's format_version differs from the reader's",
            opened(set_key("format_version", 2)),
            _re(
                "has format_version=2, expected 1: its tensors mean something else. Point cache_dir at a cache built for format_version 1, or build one into a new directory with produce_cache(..., format_version=1)"
            ),
        ),
        BadInput(
            "cache-format-version-str",
            "cache",
            'reader: format_version passed as a str ("1")',
            lambda tmp: oc.CachedTensorDataset(str(_cache(tmp)), "offline", "1", ("hidden",)),
            _re(
                "format_version='1' is a str, but the version is an int (the types differ, so it never matches): "
                "pass format_version=1"
            ),
        ),
        BadInput(
            "cache-format-version-tagged",
            "cache",
            "reader: format_version as manifest.json spells it for a ragged cache",
            lambda tmp: oc.CachedTensorDataset(
                str(_cache(tmp)), "offline", "1+tokens", ("hidden",)
            ),
            _re(
                "format_version='1+tokens' is how manifest.json records version 1 of a cache with ragged token "
                "keys: pass format_version=1"
            ),
        ),
        BadInput(
            "cache-dir-is-file",
            "cache",
            "cache_dir names manifest.json itself, not its directory",
            lambda tmp: _open(_cache(tmp) / "manifest.json"),
            _re(
                "cache_dir='<dir>/cache/manifest.json' is a file, not a cache directory; pass its directory, cache_dir='<dir>/cache'"
            ),
        ),
        BadInput(
            "cache-dir-misspelt",
            "cache",
            "cache_dir does not exist (a typo)",
            lambda tmp: _open(tmp / "cahce"),
            _re("cache_dir='<dir>/cahce': no such directory; check the path"),
            exc=oc.ManifestNotFoundError,
        ),
        BadInput(
            "cache-follow-timeout",
            "cache",
            "follow=True with follow_timeout not > 0",
            opened(_cache, follow=True, follow_timeout=0),
            _re(
                "follow_timeout=0: it must be a number of seconds > 0 (how long a read waits for a shard the "
                "producer has not committed yet); pass e.g. follow_timeout=600.0"
            ),
        ),
        BadInput(
            "cache-follow-no-producer",
            "cache",
            "follow=True on a path no producer writes (follow_timeout passes)",
            lambda tmp: _open(tmp / "nothing", follow=True, follow_timeout=0.3),
            _re(
                "waited 0.3 s (follow_timeout) for the offline cache at <dir>/nothing: it has no manifest.json "
                "and no producer records following it (.te_thd-follow.json); start its producer, or pass the "
                "cache_dir it writes"
            ),
            exc=oc.FollowTimeoutError,
        ),
        BadInput(
            "cache-follow-dir-is-file",
            "cache",
            "follow=True with cache_dir naming a file",
            lambda tmp: _open(_cache(tmp) / "manifest.json", follow=True),
            _re(
                "cache_dir='<dir>/cache/manifest.json' is a file, not a cache directory; pass its directory"
            ),
        ),
        BadInput(
            "cache-index-type",
            "cache",
            "dataset[i] with a float index",
            lambda tmp: _open(_cache(tmp))[1.0],
            _re("index=1.0 is of type float, not int; pass an index in [-6, 6) as an int"),
            exc=TypeError,
        ),
        BadInput(
            "cache-index-range",
            "cache",
            "dataset[i] with an index past the end",
            lambda tmp: _open(_cache(tmp))[5000],
            _re(
                "index=5000 is out of range for the offline cache at <dir>/cache, which holds 6 samples; pass an index in [-6, 6)"
            ),
            exc=IndexError,
        ),
        BadInput(
            "cache-getitems-index-type",
            "cache",
            "dataset.__getitems__ with an index that is not an int",
            lambda tmp: _open(_cache(tmp)).__getitems__([0, "a"]),
            _re("indices[1]='a' is of type str, not int; pass an index in [-6, 6) as an int"),
            exc=TypeError,
        ),
        BadInput(
            "cache-getitems-index-range",
            "cache",
            "dataset.__getitems__ with a negative index past the start",
            lambda tmp: _open(_cache(tmp)).__getitems__([-600]),
            _re(
                "indices[0]=-600 is out of range for the offline cache at <dir>/cache, which holds 6 samples; "
                "pass an index in [-6, 6)"
            ),
            exc=IndexError,
        ),
        BadInput(
            "cache-disk-keys-repeated",
            "cache",
            "reader: a key named twice in disk_keys",
            opened(_cache, keys=("hidden", "input_ids", "hidden")),
            _re(
                "disk_keys=('hidden', 'input_ids', 'hidden') must be a non-empty tuple of distinct key names, but names "
                "'hidden' twice; pass each key once, e.g. ('hidden', 'input_ids')"
            ),
        ),
        BadInput(
            "cache-dir-type",
            "cache",
            "reader: cache_dir is not a path (None)",
            lambda tmp: oc.CachedTensorDataset(None, "offline", 1, ("hidden",)),
            _re(
                "cache_dir=None is of type NoneType, not a path; pass a local directory (str or os.PathLike), "
                "an s3:// or an msc:// URL"
            ),
            exc=TypeError,
        ),
        BadInput(
            "cache-info-dir-type",
            "cache",
            "cache_info: cache_dir is not a path (an int)",
            lambda tmp: oc.cache_info(123),
            _re(
                "cache_dir=123 is of type int, not a path; pass a local directory (str or os.PathLike), "
                "an s3:// or an msc:// URL"
            ),
            exc=TypeError,
        ),
        BadInput(
            "cache-thd-collate-ragged-lengths",
            "cache",
            "CachedThdCollator without length_key or mask_key on a ragged cache",
            lambda tmp: oc.build_cached_dataloader(
                _open(
                    _produce(
                        tmp / "r",
                        token_keys=("input_ids",),
                        length_key="n",
                        keys=("hidden", "input_ids", "n"),
                        compute=_compute_n,
                    )
                    and tmp / "r"
                ),
                2,
                False,
                oc.CachedThdCollator(8),
            ),
            _re(
                "CachedThdCollator(length_key=None) packs every sample as its full row of L tokens, but the "
                "offline cache at <dir>/r stores ['input_ids'] ragged (each sample's real tokens "
                "only); pass CachedThdCollator(..., length_key='n') and add 'n' to the dataset's disk_keys"
            ),
        ),
        BadInput(
            "cache-no-num-samples",
            "cache",
            "the manifest has no num_samples",
            opened(drop_key("num_samples")),
            _re("manifest <dir>/cache/manifest.json has no 'num_samples' field"),
        ),
        BadInput(
            "cache-shard-size",
            "cache",
            "the manifest's shard_size is not an int >= 1",
            opened(set_key("shard_size", 0)),
            _re("has shard_size=0; it must be an int >= 1"),
        ),
        BadInput(
            "cache-schema",
            "cache",
            "the manifest's schema does not parse",
            opened(set_key("schema", {"hidden": {"dtype": "float17", "shape": [4]}})),
            _re("has an invalid 'schema'") + ".*" + _re("dtype 'float17' is not a cache dtype"),
        ),
        BadInput(
            "cache-shard-records",
            "cache",
            "the manifest lists another number of shard records",
            opened(lambda tmp: _edit_manifest(tmp, lambda m: m["shards"].pop())),
            _re("lists 2 shard records but num_samples=6 / shard_size=2 means 3"),
        ),
        BadInput(
            "cache-shard-record",
            "cache",
            "a shard record is malformed",
            opened(lambda tmp: _edit_manifest(tmp, lambda m: m["shards"][0].pop("checksum"))),
            _re("shard record 0 is"),
        ),
        BadInput(
            "cache-missing-shard",
            "cache",
            "a shard is missing (gap)",
            opened(unlink("shard-000001.safetensors")),
            _re(
                "declares 6 samples in 3 shards of 2, but has missing shard indices 1 (e.g. shard-000001.safetensors)"
            ),
        ),
        BadInput(
            "cache-extra-shard",
            "cache",
            "an extra shard index beyond the manifest",
            opened(copy_shard("shard-000002.safetensors", "shard-000005.safetensors")),
            _re("extra shard indices 5 beyond the declared 3 (e.g. shard-000005.safetensors)"),
        ),
        BadInput(
            "cache-shard-size-mismatch",
            "cache",
            "a shard's size differs from the manifest (truncated)",
            opened(truncate),
            _re("shard <dir>/cache/shard-000001.safetensors has")
            + r" \d+ bytes, the manifest records \d+",
        ),
        BadInput(
            "cache-disk-keys",
            "cache",
            "reader: disk_keys is not a non-empty tuple of names",
            opened(_cache, keys="hidden"),
            _re(
                "disk_keys='hidden' must be a non-empty tuple of distinct key names, e.g. ('hidden',)"
            ),
        ),
        BadInput(
            "cache-disk-keys-unknown",
            "cache",
            "reader: a disk key the producer did not write",
            opened(_cache, keys=("hidden", "logits")),
            _re("disk_keys ['logits'] are not in the offline cache"),
        ),
        BadInput(
            "cache-defer-unknown",
            "cache",
            "reader: defer_keys names a key the dataset does not read",
            lambda tmp: _open(_cache(tmp)).defer_keys(("hidden", "logits")),
            _re(
                "defer_keys: keys ['logits'] are not among the dataset's disk_keys ['hidden', 'input_ids']; pass keys it reads"
            ),
        ),
        BadInput(
            "cache-max-open",
            "cache",
            "reader: max_open_shards < 1",
            opened(_cache, max_open_shards=0),
            _re("max_open_shards=0 must be an int >= 1"),
        ),
        BadInput(
            "cache-read-threads",
            "cache",
            "reader: read_threads < 1",
            opened(_cache, read_threads=0),
            _re("read_threads=0 must be an int >= 1 (1: read on the calling thread only)"),
        ),
        BadInput(
            "cache-read-threads-bool",
            "cache",
            "reader: read_threads is a bool, not a thread count",
            opened(_cache, read_threads=True),
            _re("read_threads=True must be an int >= 1"),
        ),
        BadInput(
            "cache-index",
            "cache",
            "reader: sample index out of range",
            lambda tmp: _open(_cache(tmp))[6],
            "6",
            exc=IndexError,
        ),
        BadInput(
            "cache-read-schema",
            "cache",
            "reader: a shard whose dtype/shape differs from the manifest schema",
            lambda tmp: _open(
                rewrite_shard(
                    {
                        "hidden": torch.zeros(2, 4, dtype=torch.float64),
                        "input_ids": torch.zeros(2, 3, dtype=torch.long),
                    }
                )(tmp)
            ).__getitems__([2]),
            _re(
                "shard <dir>/cache/shard-000001.safetensors: key 'hidden' is float64[2, 4], the schema says float32[n, 4]"
            ),
        ),
        BadInput(
            "cache-read-rows",
            "cache",
            "reader: a shard holding another number of samples than the manifest says",
            lambda tmp: _open(
                rewrite_shard(
                    {"hidden": torch.zeros(3, 4), "input_ids": torch.zeros(3, 3, dtype=torch.long)}
                )(tmp)
            ).__getitems__([2]),
            _re(
                "shard <dir>/cache/shard-000001.safetensors: key 'hidden' holds 3 samples, the manifest puts 2 in this shard"
            ),
        ),
        BadInput(
            "cache-read-header",
            "cache",
            "reader: a shard whose safetensors header is damaged",
            lambda tmp: _open(garble_header(tmp)).__getitems__([2]),
            _re("shard <dir>/cache/shard-000001.safetensors is not a valid safetensors file"),
        ),
        BadInput(
            "cache-read-header-item",
            "cache",
            "reader, per-item path: a shard whose safetensors header is damaged",
            lambda tmp: _open(garble_header(tmp))[2],
            _re("shard <dir>/cache/shard-000001.safetensors is not a valid safetensors file"),
        ),
        # -- verify --
        BadInput(
            "cache-read-row-checksum",
            "cache",
            "reader: a flipped byte in the tensor data of a shard",
            lambda tmp: _open(flip_data(tmp)).__getitems__([2, 3]),
            _re(
                "shard <dir>/cache/shard-000001.safetensors: sample 3 (row 1 of the shard), key 'hidden': "
                "checksum mismatch (expected xxh3_64:"
            )
            + ".*"
            + _re("the batch was not returned. Repair: `te-thd cache repair <dir>/cache`"),
        ),
        BadInput(
            "cache-read-row-checksum-item",
            "cache",
            "reader, per-item path: a flipped byte in a shard's tensor data",
            lambda tmp: _open(flip_data(tmp))[3],
            _re(
                "shard <dir>/cache/shard-000001.safetensors: sample 3 (row 1 of the shard), key 'hidden': checksum mismatch"
            ),
        ),
        BadInput(
            "cache-read-header-checksum",
            "cache",
            "reader: a flipped byte that leaves the shard header valid JSON",
            lambda tmp: _open(swap_dtype(tmp)).__getitems__([2]),
            _re(
                "shard <dir>/cache/shard-000001.safetensors: header checksum mismatch (expected xxh3_64:"
            ),
        ),
        BadInput(
            "cache-read-header-entry",
            "cache",
            "reader: a flipped byte in the name of a shard header's metadata",
            lambda tmp: _open(rename_metadata(tmp)).__getitems__([2]),
            _re(
                "shard <dir>/cache/shard-000001.safetensors is not a valid safetensors file: entry '__metadatb__' "
                "is no tensor (it holds keys ['te_thd']). Repair:"
            ),
        ),
        BadInput(
            "cache-verify-checksum",
            "cache",
            "verify --deep: a flipped byte in a shard's tensor data",
            deep(flip_data),
            _re(
                "<dir>/cache/shard-000001.safetensors: sample 3 (row 1 of the shard), key 'hidden': "
                "checksum mismatch (expected xxh3_64:"
            ),
        ),
        BadInput(
            "cache-verify-swapped",
            "cache",
            "verify --deep: a sound shard of another cache in place of one of this cache's",
            deep(swap_in_other_shard),
            _re("<dir>/cache/shard-000001.safetensors: its header digest is xxh3_64:")
            + ".*"
            + _re("the manifest records xxh3_64:")
            + ".*"
            + _re("the shard was swapped for another or replaced"),
        ),
        BadInput(
            "cache-read-swapped",
            "cache",
            "reader: a sound shard of another cache in place of one of this cache's",
            lambda tmp: _open(swap_in_other_shard(tmp)).__getitems__([2]),
            _re("shard <dir>/cache/shard-000001.safetensors: its header digest is xxh3_64:")
            + ".*"
            + _re("the shard was swapped for another or replaced after the manifest was written"),
        ),
        BadInput(
            "cache-verify-schema",
            "cache",
            "verify --deep: a shard's header differs from the schema",
            deep(
                rewrite_shard(
                    {
                        "hidden": torch.zeros(2, 4, dtype=torch.float64),
                        "input_ids": torch.zeros(2, 3, dtype=torch.long),
                    }
                )
            ),
            _re(
                "<dir>/cache/shard-000001.safetensors: key 'hidden' is float64[2, 4], the schema says float32[n, 4]"
            ),
        ),
        BadInput(
            "cache-verify-algorithm",
            "cache",
            "verify --deep: an unknown checksum algorithm in the manifest",
            deep(
                lambda tmp: _edit_manifest(
                    tmp, lambda m: m["shards"][0].__setitem__("checksum", "md5:00")
                )
            ),
            _re(
                "checksum algorithm 'md5' is not supported (expected 'xxh3_64', or 'crc32' in caches of older te_thd versions)"
            ),
        ),
        BadInput(
            "cache-options-mismatch",
            "cache",
            "ensure_supervision_options_match: recorded options differ",
            options_mismatch,
            _re("was built with cp_size=2, but the run sets cp_size=4"),
        ),
        BadInput(
            "cache-options-missing",
            "cache",
            "ensure_supervision_options_match: the manifest lacks an option",
            options_missing,
            _re("does not record mask_generation_prompt"),
        ),
        # -- writer / producer --
        BadInput(
            "cache-write-missing-key",
            "cache",
            "write_tensor_shard: a key is missing",
            lambda tmp: oc.write_tensor_shard(
                str(tmp), 0, {"hidden": torch.zeros(2, 4)}, ("hidden", "ids"), "offline"
            ),
            _re("offline cache shard 0 is missing required cache keys ['ids']"),
            exc=oc.SchemaError,
        ),
        BadInput(
            "cache-write-rows",
            "cache",
            "write_tensor_shard: keys with different sample counts",
            lambda tmp: oc.write_tensor_shard(
                str(tmp), 0, {"a": torch.zeros(2, 4), "b": torch.zeros(3)}, ("a", "b"), "offline"
            ),
            _re("key 'b' has 3 samples on dim 0 but 'a' has 2"),
            exc=oc.SchemaError,
        ),
        BadInput(
            "cache-write-not-a-dict",
            "cache",
            "write_tensor_shard: samples is a tensor, not a dict of tensors",
            lambda tmp: oc.write_tensor_shard(str(tmp), 0, torch.zeros(2, 4), ("a",), "offline"),
            _re(
                "offline cache shard 0: samples is a Tensor; pass a dict of tensors, {key: [n, ...]}"
            ),
            exc=oc.SchemaError,
        ),
        BadInput(
            "cache-write-scalar",
            "cache",
            "write_tensor_shard: a 0-d tensor",
            lambda tmp: oc.write_tensor_shard(
                str(tmp), 0, {"a": torch.tensor(1.0)}, ("a",), "offline"
            ),
            _re("key 'a' is a 0-d tensor"),
            exc=oc.SchemaError,
        ),
        BadInput(
            "cache-write-dtype",
            "cache",
            "write_tensor_shard: a dtype safetensors cannot store",
            lambda tmp: oc.write_tensor_shard(
                str(tmp), 0, {"a": torch.zeros(2, dtype=torch.complex128)}, ("a",), "offline"
            ),
            _re("key 'a' has dtype torch.complex128, which safetensors cannot store"),
            exc=oc.SchemaError,
        ),
        BadInput(
            "cache-write-piece-rows",
            "cache",
            "DurableShardWriter.write_piece: the shard's row count is not an int >= 1",
            piece_rows,
            _re("rows=0 must be an int >= 1: the number of rows shard 0 will hold"),
        ),
        BadInput(
            "cache-shard-index",
            "cache",
            "shard_path: index beyond six digits",
            lambda tmp: oc.shard_path(str(tmp), 1_000_000),
            _re("shard_index=1000000 is outside [0, 1000000)"),
        ),
        BadInput(
            "cache-partition",
            "cache",
            "partition_cache_shards: rank outside [0, world_size)",
            lambda tmp: oc.partition_cache_shards(10, 2, 2, 2),
            _re("rank=2 must be an int in [0, world_size=2)"),
        ),
        BadInput(
            "cache-resume-gap",
            "cache",
            "resume_start_sample: existing shards are not a prefix",
            lambda tmp: oc.resume_start_sample({0, 2}, 4),
            _re("found 0, 2 (missing 1)"),
        ),
        BadInput(
            "cache-write-manifest-version",
            "cache",
            "write_manifest: format_version given twice, differently",
            lambda tmp: oc.write_manifest(
                str(tmp), {"format_version": 2, "num_samples": 0, "shard_size": 1}, 1
            ),
            _re("write_manifest: manifest['format_version']=2 contradicts format_version=1"),
        ),
        BadInput(
            "cache-produce-shard-size",
            "cache",
            "produce_cache: shard_size is not a positive int",
            lambda tmp: _produce(fresh(tmp), shard_size=0),
            _re("shard_size=0 must be an int >= 1 (samples per shard)"),
        ),
        BadInput(
            "cache-produce-keys",
            "cache",
            "produce_cache: keys empty or repeated",
            lambda tmp: _produce(fresh(tmp), keys=("hidden", "hidden")),
            _re("keys=('hidden', 'hidden') must be a non-empty tuple of distinct key names"),
        ),
        BadInput(
            "cache-produce-options",
            "cache",
            "produce_cache: an option named like a manifest field",
            lambda tmp: _produce(fresh(tmp), options={"shards": 1}),
            _re("options ['shards'] clash with manifest fields"),
        ),
        BadInput(
            "cache-produce-options-json",
            "cache",
            "produce_cache: an option that is not a JSON value",
            lambda tmp: _produce(fresh(tmp), options={"cp": object()}),
            _re("options must be JSON values (recorded in manifest.json)"),
        ),
        BadInput(
            "cache-produce-iterable",
            "cache",
            "produce_cache: an iterable dataset (no len)",
            lambda tmp: _produce(
                fresh(tmp), loader=torch.utils.data.DataLoader(_Iterable(), batch_size=1)
            ),
            _re("produce_cache needs a map-style dataset with len()"),
        ),
        BadInput(
            "cache-produce-not-a-loader",
            "cache",
            "produce_cache: a list of samples instead of a DataLoader",
            lambda tmp: _produce(fresh(tmp), loader=[{"idx": torch.tensor(0)}]),
            _re(
                "dataloader is a list, not a torch DataLoader; pass DataLoader(samples, batch_size=...)"
            ),
            exc=TypeError,
        ),
        BadInput(
            "cache-produce-empty",
            "cache",
            "produce_cache: an empty dataset",
            lambda tmp: _produce(fresh(tmp), n=0),
            _re("the dataloader's dataset is empty (len() == 0): there is nothing to cache"),
        ),
        BadInput(
            "cache-produce-output-file",
            "cache",
            "produce_cache: output_dir is an existing file",
            lambda tmp: (tmp / "out").write_text("x") and _produce(tmp / "out"),
            _re("output_dir='<dir>/out' is a file, not a directory; pass a directory"),
        ),
        BadInput(
            "cache-produce-token-keys",
            "cache",
            "produce_cache: token_keys names a key that is not stored",
            lambda tmp: _produce(fresh(tmp), token_keys=("hiden",)),
            _re("token_keys ['hiden'] are not stored keys ['hidden', 'input_ids']"),
        ),
        BadInput(
            "cache-produce-codec-key",
            "cache",
            "produce_cache: a codec for a key that is not a token key",
            lambda tmp: _produce(
                fresh(tmp), token_keys=("input_ids",), codecs={"hidden": "fp8_e4m3"}
            ),
            _re("codecs names 'hidden', which is not in token_keys=('input_ids',)"),
        ),
        BadInput(
            "cache-produce-codec-name",
            "cache",
            "produce_cache: an unknown storage codec",
            lambda tmp: _produce(fresh(tmp), token_keys=("hidden",), codecs={"hidden": "fp4"}),
            _re(
                "codecs['hidden']='fp4' is not a storage codec; use 'fp8_e4m3' or 'topk_index:<vocabulary size>'"
            ),
        ),
        BadInput(
            "cache-produce-index-vocab",
            "cache",
            "produce_cache: an index codec without its vocabulary size",
            lambda tmp: _produce(
                fresh(tmp), token_keys=("input_ids",), codecs={"input_ids": "topk_index"}
            ),
            _re(
                "codecs['input_ids']='topk_index' is not a storage codec (the vocabulary size must be an int in "
                "[1, 2147483648], e.g. 'topk_index:151936'); use 'fp8_e4m3' or 'topk_index:<vocabulary size>'"
            ),
        ),
        BadInput(
            "cache-produce-index-range",
            "cache",
            "produce_cache: an index outside the index codec's vocabulary",
            lambda tmp: _produce(
                fresh(tmp), token_keys=("input_ids",), codecs={"input_ids": "topk_index:50"}
            ),
            _re(
                "sample 5 (row 1 of the shard): key 'input_ids' holds index 50, outside [0, 50) of "
                "codecs['input_ids']='topk_index:50': give the codec the vocabulary size of the model that "
                "produced it, codecs={'input_ids': 'topk_index:<vocabulary size>'}; nothing of this shard was kept"
            ),
        ),
        BadInput(
            "cache-produce-world",
            "cache",
            "produce_cache: world_size > 1 without a process group",
            lambda tmp: _produce(fresh(tmp), world_size=2, rank=0),
            _re("world_size=2, rank=0 need an initialised torch.distributed process group"),
        ),
        BadInput(
            "cache-produce-schema",
            "cache",
            "produce_cache: compute_batch returns a missing key",
            lambda tmp: _produce(
                fresh(tmp), compute=lambda b: {"hidden": b["idx"][:, None].float()}
            ),
            _re("compute_batch output is missing required cache keys ['input_ids']"),
            exc=oc.SchemaError,
        ),
        BadInput(
            "cache-produce-rows",
            "cache",
            "produce_cache: compute_batch returns fewer rows than its batch has samples",
            lambda tmp: _produce(
                fresh(tmp), compute=lambda b: {k: v[:1] for k, v in _compute(b).items()}
            ),
            _re(
                "compute_batch returned 1 row for a batch of 2 samples (0..1 of the dataset): it must return one row "
                "per sample of its batch"
            ),
        ),
        BadInput(
            "cache-produce-finished",
            "cache",
            "produce_cache(resume=False) over a finished cache",
            produce_into(_cache, resume=False),
            _re("already holds a finished cache (manifest.json). Pass resume=True"),
        ),
        BadInput(
            "cache-produce-other-params",
            "cache",
            "produce_cache over a finished cache built with other parameters",
            produce_into(_cache, n=8),
            _re(
                "holds a finished cache built with other parameters (num_samples: recorded 6, this run 8)"
            ),
        ),
        BadInput(
            "cache-produce-unfinished-noresume",
            "cache",
            "produce_cache(resume=False) over an unfinished run",
            produce_into(unfinished, resume=False),
            _re("holds 3 shards of an unfinished run. Pass resume=True"),
        ),
        BadInput(
            "cache-produce-unfinished-params",
            "cache",
            "resume of an unfinished run with other parameters",
            produce_into(unfinished, options={"cp_size": 4}),
            _re(
                "holds shards of an unfinished run with other parameters (options.cp_size: recorded 2, this run 4)"
            ),
        ),
        BadInput(
            "cache-produce-orphans",
            "cache",
            "produce_cache into shards of an unknown producer",
            produce_into(orphan_shards),
            _re("holds shards (0-2) but no manifest and no producer record"),
        ),
        BadInput(
            "cache-produce-foreign-noresume",
            "cache",
            "produce_cache(resume=False) into a directory holding other files",
            produce_into(foreign, resume=False),
            _re(
                "output_dir <dir>/out is not empty: it holds notes.txt, which no te_thd producer wrote, and "
                "resume=False builds a cache only in an empty directory. Choose an empty output_dir, or pass "
                "resume=True to write the cache beside these files."
            ),
        ),
        BadInput(
            "cache-repair-live",
            "cache",
            "repair_cache while a producer is writing the cache",
            repair_held,
            _re("a producer is writing <dir>/cache (host ")
            + ".*"
            + _re(
                "repair would change the files it writes, "
                "so it changed nothing. Let the producer finish"
            ),
            exc=oc.CacheLockError,
            redact=((r"host \S+, pid \d+", "host <host>, pid <pid>"),),
        ),
        BadInput(
            "cache-lock",
            "cache",
            "a second producer on a directory another producer holds",
            held,
            _re("output_dir <dir>/cache is held by another producer (pid")
            + ".*"
            + _re("choose another output_dir"),
            exc=oc.CacheLockError,
            redact=((r"pid \d+ on host \S+", "pid <pid> on host <host>"),),
        ),
        # -- sampler / loader --
        BadInput(
            "cache-sampler-replicas",
            "cache",
            "sampler: num_replicas < 1",
            sampler(num_replicas=0, rank=0),
            _re("num_replicas=0 must be an int >= 1 (the data-parallel size)"),
        ),
        BadInput(
            "cache-sampler-rank",
            "cache",
            "sampler: rank outside [0, num_replicas)",
            sampler(num_replicas=2, rank=2),
            _re("rank=2 must be an int in [0, num_replicas=2)"),
        ),
        BadInput(
            "cache-sampler-seed",
            "cache",
            "sampler: negative seed",
            sampler(num_replicas=1, rank=0, seed=-1),
            _re("seed=-1 must be an int >= 0"),
        ),
        BadInput(
            "cache-sampler-state",
            "cache",
            "sampler: load_state_dict of a foreign state",
            lambda tmp: oc.CacheShardSampler(_open(_cache(tmp)), 1, 0).load_state_dict(
                {"epoch": 0}
            ),
            _re("sampler state is missing"),
        ),
        BadInput(
            "cache-loader-batch",
            "cache",
            "build_cached_dataloader: batch_size < 1",
            loader(batch_size=0),
            _re("batch_size=0 must be an int >= 1"),
        ),
        BadInput(
            "cache-loader-workers",
            "cache",
            "build_cached_dataloader: num_workers < 0",
            loader(num_workers=-1),
            _re("num_workers=-1 must be an int >= 0"),
        ),
        BadInput(
            "cache-loader-read-ahead",
            "cache",
            "build_cached_dataloader: read_ahead is not a bool",
            loader(read_ahead="no"),
            _re("read_ahead='no' must be True or False"),
        ),
        BadInput(
            "cache-loader-collate-pickle",
            "cache",
            "build_cached_dataloader: a lambda collate_fn with workers that do not fork (s3://, msc://, spawn)",
            loader(num_workers=1, multiprocessing_context="spawn"),
            "^"
            + _re("collate_fn='")
            + r"\S+"
            + _re(".<lambda>' cannot be pickled (AttributeError: Can't pickle local object '")
            + r"\S+"
            + _re(
                "), and the DataLoader workers start by spawn (multiprocessing_context='spawn'), which "
                "sends collate_fn to them pickled; pass a module-level function"
            ),
        ),
        BadInput(
            "cache-loader-replicas",
            "cache",
            "build_cached_dataloader: more data-parallel replicas than samples, drop_last",
            loader(batch_size=1, drop_last=True, dp_rank=0, dp_size=8),
            _re(
                "the dataset's 6 samples are too few for 8 data-parallel replicas with drop_last=True"
            ),
        ),
        BadInput(
            "cache-loader-dp",
            "cache",
            "build_cached_dataloader: dp_rank without dp_size",
            loader(dp_rank=0),
            _re("pass dp_rank and dp_size together (got dp_rank=0, dp_size=None)"),
        ),
        BadInput(
            "cache-collate-key",
            "cache",
            "collate_cached: a key the dataset did not read",
            lambda tmp: oc.collate_cached(_open(_cache(tmp)).__getitems__([0, 1]), ("logits",)),
            _re("collate_cached: key 'logits' was not read"),
        ),
        BadInput(
            "cache-collate-list-key",
            "cache",
            "collate_cached: a sample lacks a requested key",
            lambda _: oc.collate_cached([{"a": torch.zeros(2)}], ("b",)),
            _re("collate_cached: sample 0 has no key 'b' (it holds ['a'])"),
        ),
        BadInput(
            "cache-collate-list-shape",
            "cache",
            "collate_cached: samples disagree in a key's shape",
            lambda _: oc.collate_cached([{"a": torch.zeros(2)}, {"a": torch.zeros(3)}], ("a",)),
            _re("collate_cached: key 'a' of sample 1 is [3], sample 0's is [2]"),
        ),
        BadInput(
            "cache-collate-empty",
            "cache",
            "collate_cached: an empty batch",
            lambda _: oc.collate_cached([], ("a",)),
            _re("collate_cached: features is empty"),
        ),
        BadInput(
            "cache-thd-collate-cp",
            "cache",
            "CachedThdCollator: cp_rank outside [0, cp_size)",
            lambda tmp: oc.CachedThdCollator(8, cp_size=2, cp_rank=2),
            _re("cp_rank=2 must be an int in [0, cp_size=2)"),
        ),
        BadInput(
            "cache-thd-collate-lengths",
            "cache",
            "CachedThdCollator: both length_key and mask_key",
            lambda tmp: oc.CachedThdCollator(8, length_key="n", mask_key="m"),
            _re("pass length_key='n' or mask_key='m', not both"),
        ),
    ]


CASES.extend(_cache_rows())


# ------------------------------------------------------------------------------- CLI


def _cli_rows() -> list[BadInput]:
    def cli(
        *argv: str, prepare: Callable[[Path], Path] | None = None
    ) -> Callable[[Path], tuple[int, str]]:
        def run(tmp: Path) -> tuple[int, str]:
            d = prepare(tmp) if prepare else tmp / "missing"
            return run_cli([a.replace("DIR", str(d)) for a in argv])

        return run

    def empty_dir(tmp: Path) -> Path:
        (tmp / "empty").mkdir()
        return tmp / "empty"

    def corrupt(tmp: Path) -> Path:
        d = _cache(tmp)
        p = d / "shard-000002.safetensors"
        data = bytearray(p.read_bytes())
        data[-1] ^= 0x01
        p.write_bytes(bytes(data))
        return d

    def truncated(tmp: Path) -> Path:
        d = _cache(tmp)
        p = d / "shard-000000.safetensors"
        p.write_bytes(p.read_bytes()[:100])
        return d

    def bad_json(tmp: Path) -> Path:
        d = _cache(tmp)
        (d / "manifest.json").write_text("{")
        return d

    def lengths_file(text: str) -> Callable[[Path], Path]:
        def write(tmp: Path) -> Path:
            (tmp / "lengths.txt").write_text(text)
            return tmp / "lengths.txt"

        return write

    def old_shards(tmp: Path) -> Path:
        import torch

        from te_thd.offline_cache import write_tensor_shard

        d = tmp / "old"
        for i in range(2):  # shards as te_thd wrote them before they recorded their producer run
            write_tensor_shard(str(d), i, {"x": torch.ones(2, 3)}, ("x",), "offline")
        return d

    return [
        BadInput(
            "cli-verify-not-a-cache",
            "CLI",
            "te-thd cache verify DIR: a directory with no manifest and no shards",
            cli("cache", "verify", "DIR", prepare=empty_dir),
            _re(
                "te-thd cache verify: FAILED: offline cache manifest not found: cache_dir='<dir>/empty' holds no manifest.json and no shards: it is not "
                "a te_thd cache; check the path"
            ),
            kind="cli",
        ),
        BadInput(
            "cli-verify-quick-deep",
            "CLI",
            "te-thd cache verify --quick --deep: two depths at once",
            cli("cache", "verify", "--quick", "--deep", "DIR", prepare=empty_dir),
            _re("argument --deep: not allowed with argument --quick"),
            kind="cli",
        ),
        BadInput(
            "cli-repair-misspelt",
            "CLI",
            "te-thd cache repair DIR: no such directory",
            cli("cache", "repair", "DIR"),
            _re(
                "te-thd cache repair: cannot repair <dir>/missing: cache_dir='<dir>/missing': no such directory; "
                "check the path"
            ),
            kind="cli",
        ),
        BadInput(
            "cli-verify-misspelt",
            "CLI",
            "te-thd cache verify DIR: no such directory",
            cli("cache", "verify", "DIR"),
            _re(
                "te-thd cache verify: FAILED: cache_dir='<dir>/missing': no such directory; check the path"
            ),
            kind="cli",
        ),
        BadInput(
            "cli-verify-truncated",
            "CLI",
            "te-thd cache verify DIR: a truncated shard",
            cli("cache", "verify", "DIR", prepare=truncated),
            _re(
                "te-thd cache verify: FAILED: offline cache at <dir>/cache: 1 bad shard(s): <dir>/cache/shard-000000.safetensors: has 100 bytes"
            ),
            kind="cli",
        ),
        BadInput(
            "cli-verify-deep",
            "CLI",
            "te-thd cache verify --deep DIR: a flipped byte",
            cli("cache", "verify", "--deep", "DIR", prepare=corrupt),
            _re("te-thd cache verify: FAILED:")
            + ".*"
            + _re("<dir>/cache/shard-000002.safetensors: sample "),
            kind="cli",
        ),
        BadInput(
            "cli-info-json",
            "CLI",
            "te-thd cache info DIR: manifest is not JSON",
            cli("cache", "info", "DIR", prepare=bad_json),
            _re(
                "te-thd cache info: offline cache manifest <dir>/cache/manifest.json is not valid JSON"
            ),
            kind="cli",
        ),
        BadInput(
            "cli-info-missing",
            "CLI",
            "te-thd cache info DIR: no manifest",
            cli("cache", "info", "DIR"),
            _re("te-thd cache info: cache_dir='<dir>/missing': no such directory"),
            kind="cli",
        ),
        BadInput(
            "cli-repair-old-shards",
            "CLI",
            "te-thd cache repair DIR: no manifest, shards that predate the run record",
            cli("cache", "repair", "DIR", prepare=old_shards),
            _re(
                "te-thd cache repair: cannot repair <dir>/old: cannot rebuild the manifest of <dir>/old: its shards were "
                "written before shards recorded their producer run, so they do not tell format_version"
            ),
            kind="cli",
        ),
        BadInput(
            "cli-repair-options-json",
            "CLI",
            "te-thd cache repair DIR --options with text that is not JSON",
            cli("cache", "repair", "DIR", "--options", "{cp_size: 2}", prepare=old_shards),
            _re("te-thd cache repair: --options '{cp_size: 2}' is not JSON"),
            kind="cli",
        ),
        BadInput(
            "cli-plan-lengths-line",
            "CLI",
            "te-thd cache plan --lengths FILE: a line that is not a length",
            cli(
                "cache",
                "plan",
                "--lengths",
                "DIR",
                "--key",
                "input_ids=int64:L",
                prepare=lengths_file("16\n1.5e3\n"),
            ),
            _re(
                "te-thd cache plan: --lengths <dir>/lengths.txt:2 holds '1.5e3', not a length; write one integer "
                ">= 0 per line"
            ),
            kind="cli",
        ),
        BadInput(
            "cli-plan-too-long",
            "CLI",
            "te-thd cache plan: a sample longer than --max-len",
            cli(
                "cache",
                "plan",
                "--lengths",
                "DIR",
                "--key",
                "input_ids=int64:L",
                "--max-len",
                "8",
                prepare=lengths_file("16\n"),
            ),
            _re(
                "te-thd cache plan: lengths: sample 0 has length 16, longer than L=8 of the token keys; raise the "
                "padded length (te-thd cache plan --max-len) to at least 16, or truncate the samples"
            ),
            kind="cli",
        ),
        BadInput(
            "cli-plan-key",
            "CLI",
            "te-thd cache plan --key: not NAME=DTYPE[:SHAPE]",
            cli(
                "cache",
                "plan",
                "--lengths",
                "DIR",
                "--key",
                "hidden=bf16:L,64",
                prepare=lengths_file("16\n"),
            ),
            _re(
                "te-thd cache plan: --key 'hidden=bf16:L,64' is not NAME=DTYPE[:SHAPE]; write e.g. --key "
                "hidden=bfloat16:L,4096 or --key seq_len=int64"
            ),
            kind="cli",
        ),
        BadInput(
            "cli-plan-no-way-in",
            "CLI",
            "te-thd cache plan with neither --lengths/--key nor a producer flag",
            cli("cache", "plan", "--cp", "2"),
            _re(
                "te-thd cache plan: pass --lengths FILE with a --key NAME=DTYPE[:SHAPE] per stored key (any "
                "producer's cache), or the example producer's flags, e.g. --num-samples 1024 (see te-thd cache "
                "plan --help)"
            ),
            kind="cli",
        ),
        BadInput(
            "cli-plan-producer-flag",
            "CLI",
            "te-thd cache plan, the example producer's way in: a bad flag value",
            cli("cache", "plan", "--num-samples", "0", "--compact-dtypes"),
            _re("te-thd cache plan: --num-samples=0 must be >= 1"),
            kind="cli",
        ),
        BadInput(
            "cli-unlock-misspelt",
            "CLI",
            "te-thd cache unlock DIR: no such directory",
            cli("cache", "unlock", "DIR"),
            _re(
                "te-thd cache unlock: cache_dir='<dir>/missing': no such directory; check the path"
            ),
            kind="cli",
        ),
        BadInput(
            "cli-unlock-file",
            "CLI",
            "te-thd cache unlock FILE: a file, not a cache directory",
            cli("cache", "unlock", "DIR", prepare=lengths_file("not a cache\n")),
            _re(
                "te-thd cache unlock: cache_dir='<dir>/lengths.txt' is a file, not a cache directory; pass the "
                "directory that holds manifest.json and the shards"
            ),
            kind="cli",
        ),
        BadInput(
            "cli-cache-subcommand",
            "CLI",
            "te-thd cache without a subcommand",
            cli("cache"),
            _re("the following arguments are required: cache_command"),
            kind="cli",
        ),
        BadInput(
            "cli-unknown-command",
            "CLI",
            "an unknown te-thd command",
            cli("bogus"),
            _re("invalid choice: 'bogus'"),
            kind="cli",
        ),
    ]


CASES.extend(_cli_rows())


def _more_cache_rows() -> list[BadInput]:
    import logging

    import torch

    from te_thd import offline_cache as oc
    from te_thd.attention.reference import attend_slots

    def ds(tmp: Path) -> Any:
        return _open(_cache(tmp))

    def sampler_state(tmp: Path, consumed: int) -> Any:
        return oc.CacheShardSampler(ds(tmp), 1, 0).state_dict(consumed)

    def thd_collate(features: Any, **kw: Any) -> Callable[[Path], Any]:
        return lambda _: oc.CachedThdCollator(8, **kw)(features)

    ids = torch.tensor([5, 6, 7])

    def sync_low(tmp: Path) -> Any:
        from torch.utils.data import DataLoader

        return oc.write_cache_shards_distributed(
            DataLoader(IndexDataset(6), batch_size=2),
            str(tmp / "out"),
            2,
            1,
            0,
            _compute,
            lambda d, i, s: oc.write_tensor_shard(d, i, s, ("hidden", "input_ids"), "offline"),
            logging.getLogger("te_thd.catalogue"),
            sync_max_steps=lambda steps: 0,
        )

    def consumed_replicas(tmp: Path) -> Any:
        data = ds(tmp)
        state = oc.CacheShardSampler(data, 1, 0).state_dict(3)
        oc.CacheShardSampler(data, 2, 0).load_state_dict(state)

    def foreign_seed(tmp: Path) -> Any:
        data = ds(tmp)
        state = oc.CacheShardSampler(data, 1, 0).state_dict(0)
        oc.CacheShardSampler(data, 1, 0, seed=1).load_state_dict(state)

    def loader_state(tmp: Path) -> Any:
        oc.build_cached_dataloader(ds(tmp), 2, False, lambda b: b).load_state_dict({})

    def resume_and_start(tmp: Path) -> Any:
        loader = oc.build_cached_dataloader(ds(tmp), 2, False, lambda b: b)
        oc.build_cached_dataloader(
            loader.dataset, 2, False, lambda b: b, resume_state=loader.state_dict(), start_sample=2
        )

    q = torch.zeros(4, 1, 2)
    cu = torch.tensor([0, 4], dtype=torch.int32)

    return [
        BadInput(
            "cache-sampler-epoch",
            "cache",
            "sampler: negative epoch",
            lambda tmp: oc.CacheShardSampler(ds(tmp), 1, 0).set_epoch(-1),
            _re("epoch=-1 must be an int >= 0"),
        ),
        BadInput(
            "cache-sampler-shard-size",
            "cache",
            "sampler: shard_size < 1",
            lambda tmp: oc.CacheShardSampler(ds(tmp), 1, 0, shard_size=0),
            _re("shard_size=0 must be an int >= 1"),
        ),
        BadInput(
            "cache-sampler-consumed",
            "cache",
            "sampler: state_dict(consumed_samples) beyond the epoch",
            lambda tmp: sampler_state(tmp, consumed=100),
            _re("consumed_samples=100 must be an int in [0, total_size=6]"),
        ),
        BadInput(
            "cache-sampler-consumed-replicas",
            "cache",
            "sampler: a resume count the replicas cannot share",
            consumed_replicas,
            _re("consumed_samples=3 is not a multiple of num_replicas=2"),
        ),
        BadInput(
            "cache-sampler-foreign",
            "cache",
            "sampler: a state saved with other settings",
            foreign_seed,
            _re("sampler state does not match this sampler (seed: saved 0, now 1)"),
        ),
        BadInput(
            "cache-loader-resume-both",
            "cache",
            "build_cached_dataloader: resume_state and start_sample",
            resume_and_start,
            _re("pass resume_state or start_sample=2, not both"),
        ),
        BadInput(
            "cache-loader-state",
            "cache",
            "loader.load_state_dict of a foreign state",
            loader_state,
            _re("loader state must hold 'sampler' (got keys [])"),
        ),
        BadInput(
            "cache-partition-world",
            "cache",
            "partition_cache_shards: world_size < 1",
            lambda _: oc.partition_cache_shards(10, 2, 0, 0),
            _re("world_size=0 must be an int >= 1"),
        ),
        BadInput(
            "cache-partition-samples",
            "cache",
            "partition_cache_shards: negative num_samples",
            lambda _: oc.partition_cache_shards(-1, 2, 1, 0),
            _re("num_samples=-1 must be an int >= 0"),
        ),
        BadInput(
            "cache-lockstep",
            "cache",
            "write_cache_shards_distributed: sync_max_steps below this rank's steps",
            sync_low,
            _re("sync_max_steps(3) returned 0; it must return the maximum over ranks"),
        ),
        BadInput(
            "cache-write-manifest-json",
            "cache",
            "write_manifest: a value that is not JSON",
            lambda tmp: oc.write_manifest(
                str(tmp), {"num_samples": 0, "shard_size": 1, "x": object()}, 1
            ),
            _re("is not JSON-serialisable"),
        ),
        BadInput(
            "cache-thd-collate-cp-size",
            "cache",
            "CachedThdCollator: cp_size < 1",
            lambda _: oc.CachedThdCollator(8, cp_size=0),
            _re("cp_size=0 must be an int >= 1"),
        ),
        BadInput(
            "cache-thd-collate-max-num-seqs",
            "cache",
            "CachedThdCollator: max_num_seqs < 1",
            lambda _: oc.CachedThdCollator(8, max_num_seqs=0),
            _re("max_num_seqs=0 must be an int >= 1 or None"),
        ),
        BadInput(
            "cache-thd-collate-keys-str",
            "cache",
            "CachedThdCollator: keys given as one string",
            lambda _: oc.CachedThdCollator(8, keys="input_ids"),
            _re("keys='input_ids' must be a tuple of key names or None, e.g. ('input_ids',)"),
        ),
        BadInput(
            "cache-thd-collate-empty",
            "cache",
            "CachedThdCollator: no samples",
            thd_collate([]),
            _re("features is empty; a THD batch needs at least one sample"),
        ),
        BadInput(
            "cache-thd-collate-keys",
            "cache",
            "CachedThdCollator: a requested key was not read",
            thd_collate([{"input_ids": ids}], keys=("input_ids", "logits")),
            _re("keys ['logits'] were not read"),
        ),
        BadInput(
            "cache-thd-collate-input",
            "cache",
            "CachedThdCollator: the input key was not read",
            thd_collate([{"tokens": ids}]),
            _re("input_key='input_ids' was not read (read: ['tokens'])"),
        ),
        BadInput(
            "cache-thd-collate-input-shape",
            "cache",
            "CachedThdCollator: token ids not [L] per sample",
            thd_collate([{"input_ids": ids.reshape(3, 1)}]),
            _re("'input_ids' must be [L] token ids per sample, got (3, 1)"),
        ),
        BadInput(
            "cache-thd-collate-length-key",
            "cache",
            "CachedThdCollator: length_key not read",
            thd_collate([{"input_ids": ids}], length_key="n"),
            _re("length_key='n' was not read"),
        ),
        BadInput(
            "cache-thd-collate-length-dtype",
            "cache",
            "CachedThdCollator: length_key not one integer per sample",
            thd_collate([{"input_ids": ids, "n": torch.tensor([2.0])}], length_key="n"),
            _re("length_key='n' must hold one integer per sample"),
        ),
        BadInput(
            "cache-thd-collate-length-range",
            "cache",
            "CachedThdCollator: a sample length outside [1, L]",
            thd_collate([{"input_ids": ids, "n": torch.tensor([0])}], length_key="n"),
            _re("sample 0 of this batch has length 0, outside [1, L=3]"),
        ),
        BadInput(
            "cache-thd-collate-mask",
            "cache",
            "CachedThdCollator: a loss mask that is not right-padded",
            thd_collate([{"input_ids": ids, "m": torch.tensor([1, 0, 1])}], mask_key="m"),
            _re("mask_key='m' of sample 0 (of this batch) is not right-padded"),
        ),
        BadInput(
            "cache-thd-collate-label",
            "cache",
            "CachedThdCollator: label_key not read",
            thd_collate([{"input_ids": ids}], label_key="labels"),
            _re("label_key='labels' was not read"),
        ),
        BadInput(
            "cache-thd-collate-token-key",
            "cache",
            "CachedThdCollator: a token key not [L, ...] per sample",
            thd_collate([{"input_ids": ids, "h": torch.zeros(2, 4)}], token_keys=("h",)),
            _re("token_keys entry 'h' must be read and shaped [L=3, ...] per sample, got (2, 4)"),
        ),
        BadInput(
            "attn-reference-chunk",
            "attention",
            "reference attention: query_chunk_size < 1",
            lambda _: attend_slots(
                q,
                q,
                q,
                torch.arange(4),
                cu_seqlens_q=cu,
                cu_seqlens_q_padded=cu,
                cu_seqlens_kv=cu,
                cu_seqlens_kv_padded=cu,
                causal=True,
                query_chunk_size=0,
            ),
            _re("query_chunk_size must be >= 1, got 0"),
        ),
    ]


CASES.extend(_more_cache_rows())
