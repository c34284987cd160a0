"""Work-balanced global batches: equal rows and near-equal compute on every DP replica.

A data-parallel step lasts as long as its busiest replica. When each replica packs
its own share of a global batch, replicas get different numbers of rows and very
different work. :func:`plan_global_batch` plans the whole global batch at once from
the documents' lengths alone, so every rank computes the same plan without any
collective (the offline cache knows every sample's length before training).

Cost model. A document of padded length ``P`` costs ``P + P**2 / attn_scale``: the
linear term is the dense layers' matmuls (``~24 h^2`` FLOPs per token for a
``hidden_size = h`` block with a 4x MLP), the quadratic one causal attention
(``~2 h P`` per token for scores and values, half of the ``P x P`` products under a
causal mask), so ``attn_scale = 12 * h`` (49152 for ``h = 4096``). A smaller value
models an attention-heavy model; ``float('inf')`` counts tokens only.

The plan. For ``R`` replicas every replica gets the same number of rows ``K``
(fixed shapes for gradient-accumulation lockstep and CUDA graphs), the fewest that
can hold the batch, starting from the lower bound
``K >= max(ceil(sum(P) / (R * S)), ceil(n_long / R))`` (``n_long`` = documents longer
than ``S / 2``, which cannot share a row). Documents are placed in decreasing cost
order by the LPT rule (each to the least loaded replica with room, into its
best-fitting row): one document at a time while replicas are few, in vectorised
rounds when they are many (the replicas below the final mean cost, least loaded
first, take the next documents; a replica skips a document that would carry it
further past the mean than it is below it). When that balanced placement cannot fit
the batch into ``K`` rows, a packing-first placement is tried before ``K`` grows:
best-fit decreasing over all ``R * K`` rows, then whole rows dealt to replicas
(``K`` each, most expensive row to the least loaded replica).

:func:`plan_bound` is a provable lower bound on the busiest replica's cost (no plan
with that many rows per replica can do better): the mean, the costliest document,
the pigeonhole bound over the costliest documents, and the row capacity that forces
tokens onto the replica holding the costliest document.

All arithmetic on costs is element-wise or a sequential sum, so a plan is bit-for-bit
the same on every rank and every run.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from te_thd.args import check_int

__all__ = [
    "PlanBound",
    "document_costs",
    "min_rows_per_replica",
    "plan_bound",
    "plan_global_batch",
    "replica_costs",
]

#: Default ``attn_scale``: ``12 * hidden_size`` for hidden size 4096.
DEFAULT_ATTN_SCALE = 49152.0

Plan = list[list[list[int]]]

#: A plan whose busiest replica is within this factor of the mean (or, after local
#: search, of the lower bound) is not searched further.
_GOOD = 1.03


# --------------------------------------------------------------------------- validation


def _int_arg(name: str, value: Any, minimum: int, meaning: str = "") -> int:
    return check_int(name, value, minimum, numpy_ints=True, meaning=meaning)


def _lengths_array(lengths: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.detach().cpu().numpy()
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"lengths must be 1-D (one length per document), got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        if arr.dtype.kind == "f" and np.array_equal(arr, np.floor(arr)):
            pass  # whole floats are accepted as lengths
        else:
            raise ValueError(f"lengths must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and int(arr.min()) < 1:
        i = int(np.argmin(arr))
        raise ValueError(
            f"lengths[{i}]={int(arr[i])}: every document needs at least one token; "
            "drop empty documents before planning"
        )
    return arr


def _padded(lengths: np.ndarray, seq_len: int, pad_to_multiple_of: int) -> np.ndarray:
    """``[n]`` padded lengths; raises when one cannot fit a row."""
    m = pad_to_multiple_of
    padded = (lengths + (m - 1)) // m * m
    if padded.size and int(padded.max()) > seq_len:
        i = int(np.argmax(padded))
        raise ValueError(
            f"lengths[{i}]={int(lengths[i])} (padded to {int(padded[i])} with "
            f"pad_to_multiple_of={m}) > seq_len={seq_len}: a document must fit one row; "
            "truncate it first (e.g. PackingCollator(overlong='truncate')) or raise seq_len"
        )
    return padded


def _attn_scale(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ValueError(f"attn_scale={value!r} must be a number > 0 (12 * hidden_size)")
    value = float(value)
    if not value > 0:  # also rejects NaN
        raise ValueError(f"attn_scale={value!r} must be > 0 (12 * hidden_size; inf = tokens only)")
    return value


@dataclass(frozen=True)
class _Batch:
    """Validated inputs: real lengths ``L``, padded ``P`` and costs ``C`` (all ``[n]``)."""

    L: np.ndarray
    P: np.ndarray
    C: np.ndarray
    num_replicas: int
    seq_len: int

    @property
    def min_rows(self) -> int:
        """Rows per replica no equal-rows plan can go below (at least 1)."""
        R, S = self.num_replicas, self.seq_len
        tokens = -(-int(self.P.sum()) // (R * S))
        n_long = int(np.count_nonzero(2 * self.P > S))
        return max(1, tokens, -(-n_long // R))


def _batch(
    lengths: Any, num_replicas: Any, seq_len: Any, pad_to_multiple_of: Any, attn_scale: Any
) -> _Batch:
    R = _int_arg("num_replicas", num_replicas, 1, " (the data-parallel size)")
    S = _int_arg("seq_len", seq_len, 1, " (token slots per row)")
    m = _int_arg("pad_to_multiple_of", pad_to_multiple_of, 1)
    L = _lengths_array(lengths)
    P = _padded(L, S, m)
    a = _attn_scale(attn_scale)
    Pf = P.astype(np.float64)
    return _Batch(L=L, P=P, C=Pf + Pf * Pf / a, num_replicas=R, seq_len=S)


def _rows_arg(rows_per_replica: Any, batch: _Batch) -> int | None:
    if rows_per_replica is None:
        return None
    K = _int_arg("rows_per_replica", rows_per_replica, 1)
    if K < batch.min_rows:
        raise ValueError(
            f"rows_per_replica={K} is too small: {batch.P.size} documents "
            f"({int(batch.P.sum())} padded tokens) over num_replicas={batch.num_replicas} need at "
            f"least {batch.min_rows} rows of seq_len={batch.seq_len} per replica; pass "
            f"rows_per_replica>={batch.min_rows} or None"
        )
    return K


def _total(x: np.ndarray) -> float:
    """Sum in index order (``cumsum`` is sequential; ``sum`` is pairwise and its
    order may depend on SIMD width): plan decisions compare against it, so it must be
    the same on every rank."""
    return float(np.cumsum(x)[-1]) if x.size else 0.0


# --------------------------------------------------------------------------- public helpers


def document_costs(
    lengths: Sequence[int] | np.ndarray | torch.Tensor,
    pad_to_multiple_of: int = 1,
    attn_scale: float = DEFAULT_ATTN_SCALE,
) -> np.ndarray:
    """Compute cost of each document: ``P + P**2 / attn_scale`` with ``P`` its padded length.

    Returns:
        float64 ``[n]``.
    """
    L = _lengths_array(lengths)
    m = _int_arg("pad_to_multiple_of", pad_to_multiple_of, 1)
    Pf = ((L + (m - 1)) // m * m).astype(np.float64)
    return Pf + Pf * Pf / _attn_scale(attn_scale)


def min_rows_per_replica(
    lengths: Sequence[int] | np.ndarray | torch.Tensor,
    num_replicas: int,
    seq_len: int,
    pad_to_multiple_of: int = 1,
) -> int:
    """Lower bound on the rows per replica of any equal-rows plan.

    ``max(ceil(sum(P) / (R * S)), ceil(n_long / R), 1)``: the padded tokens must fit
    ``R * K`` rows of ``S``, and the ``n_long`` documents longer than ``S / 2`` need a
    row each. Per-replica FFD may need fewer rows on its busiest replica.
    """
    return _batch(lengths, num_replicas, seq_len, pad_to_multiple_of, 1.0).min_rows


@dataclass(frozen=True)
class PlanBound:
    """A provable lower bound on the busiest replica's cost.

    Attributes:
        rows_per_replica: the ``K`` the bound assumes (the plan's, or the fewest possible).
        max_cost: no plan with ``K`` rows per replica has a busiest replica below this.
        mean_cost: total cost / number of replicas.
    """

    rows_per_replica: int
    max_cost: float
    mean_cost: float

    @property
    def ratio(self) -> float:
        """``max_cost / mean_cost``: the best max/mean any plan can reach (1.0 when empty)."""
        return self.max_cost / self.mean_cost if self.mean_cost > 0 else 1.0


def plan_bound(
    lengths: Sequence[int] | np.ndarray | torch.Tensor,
    num_replicas: int,
    seq_len: int,
    pad_to_multiple_of: int = 1,
    attn_scale: float = DEFAULT_ATTN_SCALE,
    rows_per_replica: int | None = None,
) -> PlanBound:
    """Lower bound on the busiest replica's cost of any plan (same arguments as the planner).

    The largest of four bounds, each valid for every assignment of documents to
    ``R`` replicas of ``K`` rows (``K = rows_per_replica``, default the fewest possible):

    - the mean cost (the busiest replica carries at least the average);
    - the costliest document (it goes somewhere whole);
    - pigeonhole: of the ``j*R + 1`` costliest documents, some replica holds ``j + 1``,
      so it costs at least the ``j + 1`` cheapest of them;
    - capacity: every other replica holds at most ``K * S`` padded tokens, so the
      replica holding the costliest document holds at least ``sum(P) - (R-1)*K*S``
      tokens; the rest of them cost at least what the shortest other documents
      cost per token (fractionally).
    """
    b = _batch(lengths, num_replicas, seq_len, pad_to_multiple_of, attn_scale)
    K = _rows_arg(rows_per_replica, b)
    return _bound(b, b.min_rows if K is None else K)


def _bound(b: _Batch, K: int) -> PlanBound:
    R, S, n = b.num_replicas, b.seq_len, b.P.size
    if n == 0:
        return PlanBound(K, 0.0, 0.0)
    c = np.sort(b.C)[::-1]
    cs = np.concatenate([[0.0], np.cumsum(c)])
    mean = float(cs[-1]) / R
    best = max(mean, float(c[0]))
    j = np.arange(1, (n - 1) // R + 1)
    if j.size:
        best = max(best, float((cs[j * R + 1] - cs[j * R - j]).max()))
    # The replica holding the costliest document holds at least ``forced`` padded
    # tokens; the cheapest way to make up the rest is the shortest other documents
    # (cost per token grows with length), taken fractionally.
    top = int(np.argmax(b.C))
    rest = int(b.P.sum()) - (R - 1) * K * S - int(b.P[top])
    if rest > 0:
        others = np.argsort(b.P, kind="stable")
        others = others[others != top]
        tok = np.cumsum(b.P[others])
        cost = np.cumsum(b.C[others])
        j = int(np.searchsorted(tok, rest))  # first prefix reaching ``rest`` tokens
        before_tok = float(tok[j - 1]) if j else 0.0
        before_cost = float(cost[j - 1]) if j else 0.0
        d = others[j]
        cover = before_cost + (rest - before_tok) * float(b.C[d]) / float(b.P[d])
        best = max(best, float(b.C[top]) + cover)
    return PlanBound(K, best, mean)


def replica_costs(
    plan: Plan,
    lengths: Sequence[int] | np.ndarray | torch.Tensor,
    pad_to_multiple_of: int = 1,
    attn_scale: float = DEFAULT_ATTN_SCALE,
) -> np.ndarray:
    """Cost each replica of ``plan`` carries, float64 ``[len(plan)]``."""
    costs = document_costs(lengths, pad_to_multiple_of, attn_scale)
    return np.array([sum(float(costs[i]) for row in rep for i in row) for rep in plan])


# --------------------------------------------------------------------------- placements


def _place_lpt(b: _Batch, order: np.ndarray, K: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Balance-first placement one document at a time (few replicas); None when it cannot fit.

    The LPT rule exactly: each document, in decreasing cost, goes to the least loaded
    replica (ties: lowest index) that has a row with room, into its best-fitting
    row. A heap of ``(load, replica)`` and per-replica sorted free-slot lists keep a
    step at a few list operations, which beats numpy rounds while ``R`` is small.

    Returns ``(replica, row)``, int64 ``[n]`` each.
    """
    R, S = b.num_replicas, b.seq_len
    sizes, costs = b.P.tolist(), b.C.tolist()
    free = [[S] * K for _ in range(R)]  # per replica: free slots of its rows, ascending
    rows = [list(range(K)) for _ in range(R)]  # the row id of each entry of ``free``
    heap = [(0.0, r) for r in range(R)]
    n = len(sizes)
    replica, row = [0] * n, [0] * n
    for d in order.tolist():
        p = sizes[d]
        skipped = []
        while True:  # the least loaded replica with room for ``p``
            if not heap:
                return None
            load, r = heapq.heappop(heap)
            if free[r][-1] >= p:
                break
            skipped.append((load, r))
        f, ids = free[r], rows[r]
        j = bisect.bisect_left(f, p)  # best fit: the fullest row that still has room
        room, k = f.pop(j), ids.pop(j)
        j = bisect.bisect_left(f, room - p)
        f.insert(j, room - p)
        ids.insert(j, k)
        replica[d], row[d] = r, k
        heapq.heappush(heap, (load + costs[d], r))
        for item in skipped:
            heapq.heappush(heap, item)
    return np.asarray(replica, dtype=np.int64), np.asarray(row, dtype=np.int64)


def _place_balanced(b: _Batch, order: np.ndarray, K: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Balance-first placement into ``K`` rows per replica; None when it cannot fit.

    Rounds over ``order`` (decreasing cost): the replicas below the mean cost,
    least loaded first, are paired with the next documents, largest first. A pair
    is kept when the document fits one of the replica's rows (best fit) and does not
    carry the replica further past the mean than it is below it (``load + c/2 <=
    mean``); the round's first pair (the LPT move) is always kept when it fits.
    Skipped documents stay at the front of the pool for the next round.

    Returns ``(replica, row)``, int64 ``[n]`` each.
    """
    P, C, R, S = b.P, b.C, b.num_replicas, b.seq_len
    n = order.size
    level = _total(C) / R
    load = np.zeros(R)
    res = np.full((R, K), S, dtype=np.int64)  # [R, K] free slots of each row
    replica = np.empty(n, dtype=np.int64)
    row = np.empty(n, dtype=np.int64)
    pool = order
    rows_of = np.arange(R) * K  # flat index of each replica's first row
    flat = res.reshape(-1)
    # a round is a few dozen numpy calls on arrays of at most R elements, so their
    # fixed cost is the planner's cost: methods, not module functions, and no call
    # whose answer another already gives
    while pool.size:
        by_load = load.argsort(kind="stable")
        # replicas below the mean, least loaded first (all of them only if rounding
        # left documents with every replica at the mean)
        m = min(int((load < level).sum()) or R, pool.size)
        reps, items = by_load[:m], pool[:m]
        p = P[items]
        free = res[reps]  # [m, K]
        k = np.where(free >= p[:, None], free, S + 1).argmin(1)  # best-fitting row
        slots = rows_of[reps] + k
        fits = flat[slots] >= p
        if not fits[0]:
            # the least loaded replica has no room for the largest document: give it
            # to the least loaded replica that has (or fail: K rows are too few)
            d = int(items[0])
            room = np.flatnonzero(res.max(1) >= P[d])
            if room.size == 0:
                return None
            r = int(room[load[room].argmin()])
            kk = int(np.where(res[r] >= P[d], res[r], S + 1).argmin())
            res[r, kk] -= P[d]
            load[r] += C[d]
            replica[d], row[d] = r, kk
            pool = pool[1:]
            continue
        c = C[items]
        keep = fits & (load[reps] + 0.5 * c <= level)
        keep[0] = True
        if keep.sum() == m:
            pool = pool[m:]
        else:
            pool = np.concatenate((items[~keep], pool[m:]))
            reps, items, slots, p, c, k = (
                reps[keep],
                items[keep],
                slots[keep],
                p[keep],
                c[keep],
                k[keep],
            )
        flat[slots] -= p
        load[reps] += c
        replica[items] = reps
        row[items] = k
    return replica, row


def _place_packed(b: _Batch, order: np.ndarray, K: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Packing-first placement: best-fit decreasing into ``R*K`` rows, rows dealt to replicas.

    For batches the balanced placement cannot fit (rows nearly full). Rows are dealt
    most expensive first to the least loaded replica that has fewer than ``K`` rows.
    None when best fit decreasing needs more than ``R*K`` rows.
    """
    P, C, R, S = b.P, b.C, b.num_replicas, b.seq_len
    n = order.size
    free: list[int] = []  # free slots of the open rows, ascending
    ids: list[int] = []  # row id of each entry of ``free``
    row_of = [0] * n
    sizes = P.tolist()
    opened = 0
    for d in order.tolist():
        p = sizes[d]
        j = bisect.bisect_left(free, p)
        if j == len(free):  # no open row has room: open one
            if opened == R * K:
                return None
            room, rid = S, opened
            opened += 1
        else:
            room, rid = free.pop(j), ids.pop(j)
        row_of[d] = rid
        j = bisect.bisect_left(free, room - p)
        free.insert(j, room - p)
        ids.insert(j, rid)
    rows = np.asarray(row_of, dtype=np.int64)
    row_cost = np.bincount(rows, weights=C, minlength=R * K)
    heap = [(0.0, r) for r in range(R)]
    count = [0] * R
    replica_of_row = np.empty(R * K, dtype=np.int64)
    slot_of_row = np.empty(R * K, dtype=np.int64)
    for rid in np.argsort(-row_cost, kind="stable").tolist():
        load, r = heapq.heappop(heap)
        replica_of_row[rid], slot_of_row[rid] = r, count[r]
        count[r] += 1
        if count[r] < K:
            heapq.heappush(heap, (load + float(row_cost[rid]), r))
    return replica_of_row[rows], slot_of_row[rows]


def _improve(b: _Batch, replica: np.ndarray, row: np.ndarray, K: int, target: float) -> None:
    """Local search, in place: lower the busiest replica's cost until ``target``.

    Each step takes the busiest replica and applies its best single move (one of its
    documents into a row of another replica with room) or swap (one of its documents
    against a cheaper one of another replica, both rows still fitting) whose two
    replicas both end below the current maximum; it stops when none exists, at
    ``target``, or after ``2 * R + 16`` steps. The maximum never grows.
    """
    P, C, R, S = b.P, b.C, b.num_replicas, b.seq_len
    slot = replica * K + row
    load = np.bincount(replica, weights=C, minlength=R)
    free = S - np.bincount(slot, weights=P, minlength=R * K).astype(np.int64)  # [R*K]
    row_replica = np.arange(R * K) // K
    for _ in range(2 * R + 16):
        top = int(np.argmax(load))
        peak = float(load[top])
        if peak <= target:
            return
        mine = np.flatnonzero(replica == top)
        other = np.flatnonzero(replica != top)
        if other.size == 0 and K == 1 and R == 1:
            return
        cm, pm = C[mine][:, None], P[mine][:, None]
        # moves: [mine, R*K] destination rows of other replicas with room
        fits = (free[None, :] >= pm) & (row_replica[None, :] != top)
        move_peak = np.where(fits, np.maximum(peak - cm, load[row_replica][None, :] + cm), np.inf)
        # swaps: [mine, other]; delta > 0 moves cost off the busiest replica
        delta = cm - C[other][None, :]
        ok = (delta > 0) & (free[slot[mine]][:, None] + pm >= P[other][None, :])
        ok &= free[slot[other]][None, :] + P[other][None, :] >= pm
        swap_peak = np.where(
            ok, np.maximum(peak - delta, load[replica[other]][None, :] + delta), np.inf
        )
        i_move = int(np.argmin(move_peak))
        i_swap = int(np.argmin(swap_peak)) if other.size else 0
        best_move = float(move_peak.flat[i_move])
        best_swap = float(swap_peak.flat[i_swap]) if other.size else np.inf
        if min(best_move, best_swap) >= peak:
            return
        if best_move <= best_swap:
            d, g = int(mine[i_move // (R * K)]), i_move % (R * K)
            free[slot[d]] += P[d]
            free[g] -= P[d]
            load[top] -= C[d]
            load[g // K] += C[d]
            slot[d], replica[d], row[d] = g, g // K, g % K
        else:
            d, e = int(mine[i_swap // other.size]), int(other[i_swap % other.size])
            gd, ge = int(slot[d]), int(slot[e])
            free[gd] += P[d] - P[e]
            free[ge] += P[e] - P[d]
            load[top] += C[e] - C[d]
            load[ge // K] += C[d] - C[e]
            slot[d], slot[e] = ge, gd
            replica[d], row[d], replica[e], row[e] = ge // K, ge % K, gd // K, gd % K


# --------------------------------------------------------------------------- planner


def plan_global_batch(
    lengths: Sequence[int] | np.ndarray | torch.Tensor,
    num_replicas: int,
    seq_len: int,
    pad_to_multiple_of: int = 1,
    attn_scale: float = DEFAULT_ATTN_SCALE,
    rows_per_replica: int | None = None,
) -> Plan:
    """Plan one global batch: equal rows per replica, balanced cost, no collective.

    Args:
        lengths: ``[n]`` ints >= 1, the real token counts of the global batch's
            documents (1-D sequence, ndarray or tensor).
        num_replicas: ``R``, the data-parallel size.
        seq_len: ``S``, token slots per row.
        pad_to_multiple_of: each document's span is padded to this multiple (as the
            packing collator does; ``2*cp`` under context parallelism).
        attn_scale: the cost model's ``P + P**2 / attn_scale`` (``12 * hidden_size``).
        rows_per_replica: ``K``; None = the fewest rows that fit (see
            :func:`min_rows_per_replica` for the bound it starts from).

    Returns:
        ``plan[r][k]`` = indices into ``lengths`` of the documents of replica ``r``'s
        row ``k``, ascending (arrival order). Every index appears exactly once, every
        replica has exactly ``K`` rows (a row may be empty), and each row's padded
        tokens fit ``seq_len``. The same inputs give the same plan on every rank.

    Raises:
        ValueError: a length < 1 or above ``seq_len`` once padded, ``num_replicas < 1``,
            or ``rows_per_replica`` too small (the message says how many are needed).
    """
    b = _batch(lengths, num_replicas, seq_len, pad_to_multiple_of, attn_scale)
    asked = _rows_arg(rows_per_replica, b)
    n = b.P.size
    K = b.min_rows if asked is None else asked
    if n == 0:
        return [[[] for _ in range(K)] for _ in range(b.num_replicas)]
    order = np.lexsort((np.arange(n), -b.C))  # decreasing cost, ties in arrival order
    # Per document while replicas are few; in vectorised rounds when they are many,
    # where one round's fixed cost is spread over up to R documents.
    balanced = _place_lpt if b.num_replicas <= 24 or n < 100 else _place_balanced
    while True:
        placed = balanced(b, order, K) or _place_packed(b, order, K)
        if placed is not None:
            break
        K += 1
    replica, row = placed
    load = np.bincount(replica, weights=b.C, minlength=b.num_replicas)
    mean = _total(load) / b.num_replicas
    if float(load.max()) > _GOOD * mean:
        _improve(b, replica, row, K, _GOOD * _bound(b, K).max_cost)
    if asked is not None and K != asked:
        raise ValueError(
            f"rows_per_replica={asked} cannot hold this global batch of {n} documents over "
            f"num_replicas={b.num_replicas}: the planner needs {K} rows of seq_len={b.seq_len} "
            f"per replica (the lower bound is {b.min_rows}); pass rows_per_replica>={K} or None"
        )
    return _as_plan(replica, row, b.num_replicas, K)


def _as_plan(replica: np.ndarray, row: np.ndarray, R: int, K: int) -> Plan:
    """Nested lists ``[R][K][docs]`` from per-document ``(replica, row)``."""
    key = replica * K + row
    docs = np.argsort(key, kind="stable").tolist()  # by row, arrival order inside
    ends = np.cumsum(np.bincount(key, minlength=R * K)).tolist()
    rows, start = [], 0
    for end in ends:
        rows.append(docs[start:end])
        start = end
    return [rows[r * K : (r + 1) * K] for r in range(R)]
