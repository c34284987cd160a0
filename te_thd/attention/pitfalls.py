"""Known Transformer Engine / Megatron THD pitfalls, checked against one call's kwargs.

:func:`check_te_thd_kwargs` returns one line per problem that the kwargs of a TE
``DotProductAttention.forward`` THD call (plus, optionally, the
``load_balancing_strategy`` of ``set_context_parallel_group``) would hit on a given TE
version. Unlike :func:`te_thd.attention.check_te_thd_args` (TE's contract, which
raises), these are version-dependent behaviours of valid-looking calls. Each rule
names the TE source it was read from; ``docs/megatron-te.md`` tabulates them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from te_thd._cp_strategy import (
    DUAL_CHUNK_SWAP,
    STRATEGIES,
    TE_ENUM_VERSION,
    accepted_values,
    installed_te_version,
    te_strategy_enum,
)

__all__ = ["check_te_thd_kwargs"]

Version = tuple[int, int, int]

#: TE >= 2.18 decides an omitted pad_between_seqs by tensor identity (TE commit 4cd705b);
#: before, by the values of ``cu_seqlens[:-1]`` (blind to a tail pad).
_IDENTITY_AUTODETECT: Version = (2, 18, 0)
_ENUM: Version = tuple(int(p) for p in TE_ENUM_VERSION.split(".")) + (0,)  # type: ignore[assignment]
_VERSION = re.compile(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?")


def _parse_version(te_version: str) -> Version:
    match = _VERSION.match(te_version) if isinstance(te_version, str) else None
    if match is None:
        raise ValueError(
            f"te_version={te_version!r} is not a TE version; pass a string such as '2.18.0', "
            "or None for the installed TE"
        )
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def _name(version: Version | None, lo: Version | None = None, hi: Version | None = None) -> str:
    """How a line names the TE version: the one checked, or the range a rule holds on."""
    if version is not None:
        return "TE " + ".".join(map(str, version))
    if lo is not None:
        return "TE >= " + ".".join(map(str, lo[:2]))
    if hi is not None:
        return "TE <= " + ".".join(map(str, hi))
    return "every TE version"


def _in(version: Version | None, lo: Version | None = None, hi: Version | None = None) -> bool:
    """Whether a rule for ``[lo, hi]`` applies: always when the version is unknown."""
    if version is None:
        return True
    return (lo is None or version >= lo) and (hi is None or version <= hi)


def _values(t: Any) -> list[int] | None:
    """A boundary tensor's values (a device sync for a CUDA tensor), or None if not a tensor."""
    return t.tolist() if isinstance(t, torch.Tensor) else None


def _pairs(kwargs: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(tag, cu_seqlens_<tag>, cu_seqlens_<tag>_padded)`` for q and kv, padded ones given."""
    out = []
    for tag in ("q", "kv"):
        cu, cup = kwargs.get(f"cu_seqlens_{tag}"), kwargs.get(f"cu_seqlens_{tag}_padded")
        if isinstance(cu, torch.Tensor) and isinstance(cup, torch.Tensor):
            out.append((tag, cu, cup))
    return out


def _differs(cu: torch.Tensor, cup: torch.Tensor, tail: bool = True) -> bool:
    if cup is cu:
        return False
    a, b = _values(cu), _values(cup)
    return (a != b) if tail else (a[:-1] != b[:-1])  # type: ignore[index]


def _pad_false_with_padding(kw: Mapping[str, Any], v: Version | None, head_dim: Any) -> list[str]:
    """NVIDIA/TransformerEngine#3331: ``pad_between_seqs=False`` (given, or auto-detected on <=
    2.17.1 from ``cu_seqlens[:-1]`` only) over boundaries that differ: THD+CP p2p takes the
    no-padding path and mislabels chunk-boundary rows."""
    pad = kw.get("pad_between_seqs")
    if pad is not False and (pad is not None or not _in(v, hi=(2, 17, 1))):
        return []
    out = []
    for tag, cu, cup in _pairs(kw):
        if not _differs(cu, cup):
            continue
        fix = "pass pad_between_seqs=True (te_attention_kwargs decides it on the complete arrays)"
        if pad is False:
            out.append(
                f"pad_between_seqs=False but cu_seqlens_{tag}_padded {_values(cup)} differs from "
                f"cu_seqlens_{tag} {_values(cu)}: on {_name(v)} THD+CP p2p attention takes the "
                f"no-padding path and is silently wrong (NVIDIA/TransformerEngine#3331); fix: {fix}"
            )
        elif pad is None and _in(v, hi=(2, 17, 1)) and not _differs(cu, cup, tail=False):
            out.append(
                f"pad_between_seqs=None with padding only after the last sequence "
                f"(cu_seqlens_{tag}_padded ends at {int(cup[-1])}, cu_seqlens_{tag} at "
                f"{int(cu[-1])}): {_name(v, hi=(2, 17, 1))} auto-detects False from "
                "cu_seqlens[:-1] and THD+CP p2p attention is silently wrong "
                f"(NVIDIA/TransformerEngine#3331); fix: {fix}"
            )
        break  # one line per problem: q and kv share the cause
    return out


def _equal_but_distinct(kw: Mapping[str, Any], v: Version | None, head_dim: Any) -> list[str]:
    """NVIDIA/TransformerEngine#3487: TE >= 2.18 auto-detects ``pad_between_seqs`` by identity, so
    distinct tensors of equal values count as padding (the slower exact CP path, padding-only
    backends)."""
    if kw.get("pad_between_seqs") is not None or not _in(v, lo=_IDENTITY_AUTODETECT):
        return []
    for tag, cu, cup in _pairs(kw):
        if cup is not cu and not _differs(cu, cup):
            return [
                f"pad_between_seqs=None with cu_seqlens_{tag}_padded a distinct tensor equal to "
                f"cu_seqlens_{tag}: {_name(v, lo=_IDENTITY_AUTODETECT)} auto-detects padding "
                "by identity and takes the padded path (slower THD+CP p2p; FlashAttention 2/4 "
                "and unfused attention disabled) (NVIDIA/TransformerEngine#3487); fix: pass "
                "pad_between_seqs=False, or the same tensor for both (te_attention_kwargs does)"
            ]
    return []


def _te_pads(kw: Mapping[str, Any], v: Version | None) -> bool:
    """The ``pad_between_seqs`` TE resolves (an omitted one: True if any version would)."""
    pad = kw.get("pad_between_seqs")
    if pad is not None:
        return bool(pad)
    pairs = _pairs(kw)
    by_identity = any(cup is not cu for _, cu, cup in pairs)
    by_value = any(_differs(cu, cup, tail=False) for _, cu, cup in pairs)
    if v is None:
        return by_identity or by_value
    return by_identity if v >= _IDENTITY_AUTODETECT else by_value


def _no_backend_for_padding(kw: Mapping[str, Any], v: Version | None, head_dim: Any) -> list[str]:
    """TE ``get_attention_backend`` (utils.py): THD with ``pad_between_seqs`` disables
    FlashAttention 2/4 and unfused attention; FlashAttention 3 takes head_dim <= 256
    (sm90), and cuDNN's FusedAttention trains head_dim > 128 only on sm90 (cuDNN >= 9.5)
    or, for 256 on sm100, cuDNN >= 9.25 (``fused_attn.cpp``). NVIDIA/Megatron-LM#7417 hit
    head_dim 256 with no backend."""
    if head_dim is None or not _te_pads(kw, v):
        return []
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"head_dim={head_dim!r} must be a positive int (the q/k head size)")
    if head_dim <= 128:
        return []
    where = (
        "no backend trains it on any GPU"
        if head_dim > 256
        else "only sm90 (FusedAttention with cuDNN >= 9.5, or FlashAttention 3 on TE >= 2.17) "
        "and, for 256, sm100 with cuDNN >= 9.25 train it; elsewhere no backend is left"
    )
    if not any(_differs(cu, cup) for _, cu, cup in _pairs(kw)):
        fix = "pass pad_between_seqs=False: the boundary arrays are equal"
    else:
        fix = (
            "remove the padding between sequences so pad_between_seqs is False (count each "
            "sequence's CP alignment padding as its tokens), or train on a GPU listed"
        )
    return [
        f"pad_between_seqs=True with head_dim={head_dim}: on {_name(v)} get_attention_backend "
        "disables FlashAttention 2/4 and unfused attention for THD padding between sequences, "
        f"and {where} (NVIDIA/Megatron-LM#7417); fix: {fix}"
    ]


def _strategy_unknown(kw: Mapping[str, Any], v: Version | None, head_dim: Any) -> list[str]:
    """TE's ``CPLoadBalancingStrategy``: a strategy the TE checked does not know."""
    if "load_balancing_strategy" not in kw:
        return []
    given = kw["load_balancing_strategy"]
    value = getattr(given, "value", given)
    if value not in STRATEGIES:
        return [
            f"load_balancing_strategy={given!r} is not a strategy TE knows; fix: use "
            f"{accepted_values()}"
        ]
    if value == DUAL_CHUNK_SWAP and given == value:
        return []  # a plain name for the default: every TE partitions so
    if v is None and installed_te_version() is not None:
        cls = te_strategy_enum()
        if cls is not None and value in {m.value for m in cls}:
            return []
        version = f"TE {installed_te_version()}"
    elif v is not None and v >= _ENUM:
        return []
    else:
        version = _name(v, hi=None) if v is not None else f"TE < {TE_ENUM_VERSION}"
    return [
        f"load_balancing_strategy={given!r} needs TE's CPLoadBalancingStrategy (expected in "
        f"TE {TE_ENUM_VERSION}), which {version} lacks; fix: install a TE that has it, or use "
        f"'{DUAL_CHUNK_SWAP}' (te_cp_group_kwargs gives {{}} for it)"
    ]


_RULES: tuple[Callable[[Mapping[str, Any], Version | None, Any], list[str]], ...] = (
    _pad_false_with_padding,
    _equal_but_distinct,
    _no_backend_for_padding,
    _strategy_unknown,
)


def check_te_thd_kwargs(
    kwargs: Mapping[str, Any], te_version: str | None = None, head_dim: int | None = None
) -> list[str]:
    """The known TE / Megatron THD problems of one call's kwargs; ``[]`` when none.

    Args:
        kwargs: the THD kwargs of ``DotProductAttention.forward`` (int32 ``[N+1]``
            ``cu_seqlens_q/kv`` and ``cu_seqlens_q/kv_padded``, ``pad_between_seqs``
            bool or None), optionally with ``load_balancing_strategy`` (the argument
            of ``set_context_parallel_group``). Boundary values are read on the host
            (a device sync for CUDA tensors).
        te_version: the TE to check for, e.g. ``"2.18.0"``; None: the installed TE, or
            every version (each line naming the versions it holds on) without one.
        head_dim: the attention head size; None skips the backend rule.

    Returns:
        One line per problem, each naming the field, its value, the TE version and the fix.

    Raises:
        ValueError: ``kwargs`` not a mapping, or a malformed ``te_version`` / ``head_dim``.
    """
    if not isinstance(kwargs, Mapping):
        raise ValueError(
            f"kwargs must be the dict of TE THD kwargs (te_attention_kwargs output), got "
            f"{type(kwargs).__name__}"
        )
    if te_version is not None:
        version: Version | None = _parse_version(te_version)
    else:
        installed = installed_te_version()
        version = None if installed is None else _parse_version(installed)
    return [line for rule in _RULES for line in rule(kwargs, version, head_dim)]
