"""TE's context-parallel load-balancing strategies: their names, and the installed TE's enum.

Transformer Engine names the way a THD batch is split over CP ranks with
``transformer_engine.pytorch.constants.CPLoadBalancingStrategy``, whose values are the
strings te_thd accepts:

- ``"dual_chunk_swap"`` (TE's default, and te_thd's): every padded sequence is cut
  into ``2 * cp_size`` chunks and rank ``r`` holds chunks ``r`` and ``2*cp_size-1-r``;
- ``"no_load_balance"`` (experimental in TE; all-gather THD CP only): rank ``r`` holds
  the ``r``-th of ``cp_size`` equal contiguous pieces of the whole packed stream.

A TE enum member is accepted by its value, read from the member itself, so checking
one never imports TE. Whether the *installed* TE knows the enum is a feature test
(the class exists), not a version comparison.
"""

from __future__ import annotations

import enum
import functools
import importlib
import importlib.metadata
import importlib.util
from typing import Any

DUAL_CHUNK_SWAP = "dual_chunk_swap"
NO_LOAD_BALANCE = "no_load_balance"
#: The strategies te_thd partitions by, default first.
STRATEGIES: tuple[str, ...] = (DUAL_CHUNK_SWAP, NO_LOAD_BALANCE)
#: The TE release expected to bring the enum (named in the line that asks for a newer TE).
TE_ENUM_VERSION = "2.20"
_TE_ENUM = "CPLoadBalancingStrategy"
_TE_MODULE = "transformer_engine.pytorch.constants"


def accepted_values() -> str:
    """The accepted spellings, for error messages: the strings, and TE's members."""
    members = " / ".join(f"{_TE_ENUM}.{s.upper()}" for s in STRATEGIES)
    return f"'{DUAL_CHUNK_SWAP}' (the default), '{NO_LOAD_BALANCE}', or TE's {members}"


def normalize_strategy(strategy: Any, name: str = "strategy") -> str:
    """The strategy's name: one of :data:`STRATEGIES`.

    Args:
        strategy: a name from :data:`STRATEGIES`, or a member of TE's
            ``CPLoadBalancingStrategy`` (any enum of that class name whose value is one).
        name: how the error message calls the argument.

    Raises:
        ValueError: anything else, in one line listing the accepted values.
    """
    if type(strategy) is str and strategy in STRATEGIES:  # the hot path: a plain name
        return strategy
    if (
        isinstance(strategy, enum.Enum)
        and type(strategy).__name__ == _TE_ENUM
        and strategy.value in STRATEGIES
    ):
        return str(strategy.value)
    raise ValueError(
        f"{name}={strategy!r} is not a CP load-balancing strategy; use {accepted_values()}"
    )


@functools.lru_cache(maxsize=1)
def installed_te_version() -> str | None:
    """The installed Transformer Engine's version string, or None when it is not installed
    (looked up once per process: a batch's kwargs ask for it)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return None
    for dist in ("transformer_engine", "transformer-engine", "transformer_engine_torch"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    module = importlib.import_module("transformer_engine")
    return str(getattr(module, "__version__", "unknown"))


@functools.lru_cache(maxsize=1)
def te_strategy_enum() -> type[enum.Enum] | None:
    """The installed TE's ``CPLoadBalancingStrategy``, or None (no TE, or a TE without it)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return None
    try:
        module = importlib.import_module(_TE_MODULE)
    except ImportError:
        return None
    return getattr(module, _TE_ENUM, None)


def te_strategy_member(strategy: Any) -> enum.Enum:
    """The installed TE's enum member for ``strategy``.

    Raises:
        ValueError: an unknown strategy; or no installed TE that has the enum (one line
            naming the TE version needed).
    """
    value = normalize_strategy(strategy)
    cls = te_strategy_enum()
    if cls is None or value not in {m.value for m in cls}:
        have = installed_te_version()
        installed = "no Transformer Engine is installed" if have is None else f"TE {have} has not"
        raise ValueError(
            f"strategy={value!r} needs Transformer Engine's {_TE_MODULE}.{_TE_ENUM} with "
            f"that member (expected in TE {TE_ENUM_VERSION}) and {installed}; install a TE "
            f"that has it, or use strategy='{DUAL_CHUNK_SWAP}'"
        )
    return cls(value)


def te_cp_group_kwargs(strategy: Any = DUAL_CHUNK_SWAP) -> dict[str, Any]:
    """Keyword arguments for TE's ``set_context_parallel_group`` that carry the strategy.

    Pass them after TE's four positional arguments (group, global ranks, stream, comm
    type). The default strategy gives ``{}`` -- the call
    every TE accepts, as TE's own ``MultiheadAttention`` makes it for the default --
    and any other gives ``{"load_balancing_strategy": <TE enum member>}``.

    Raises:
        ValueError: an unknown strategy, or one the installed TE does not know
            (one line naming the TE version needed).
    """
    if normalize_strategy(strategy) == DUAL_CHUNK_SWAP:
        return {}
    return {"load_balancing_strategy": te_strategy_member(strategy)}
