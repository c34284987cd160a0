"""The one check of an integer argument and of a tuple of key names, and the rules behind them.

:func:`is_int` is the rule (an ``int``, never a ``bool``, optionally within a range);
:func:`check_int` applies it to an argument and, when it fails, raises one line that
names the argument, the value and what it must be::

    check_int("shard_size", 0, 1, meaning=" (samples per shard)")
    # ValueError: shard_size=0 must be an int >= 1 (samples per shard)

Parsers of te_thd's own files (a manifest's counts, a shard header's fields) use
:func:`is_int` and word their own errors: there the value is damaged data, not an
argument the caller can fix. :func:`check_names` is the same for an argument that
names tensor keys (``keys``, ``disk_keys``, ``token_keys``)::

    check_names("disk_keys", "input_ids")
    # ValueError: disk_keys='input_ids' must be a tuple of key names, e.g. ('input_ids',)
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

__all__ = ["check_index", "check_int", "check_names", "check_path", "is_int"]


def is_int(
    value: Any, minimum: int | None = None, below: int | None = None, *, numpy_ints: bool = False
) -> bool:
    """Whether ``value`` is an int (not a bool; a numpy integer too with ``numpy_ints``) in
    ``[minimum, below)``."""
    types: tuple[type, ...] = (int, np.integer) if numpy_ints else (int,)
    if isinstance(value, bool | np.bool_) or not isinstance(value, types):
        return False
    return (minimum is None or value >= minimum) and (below is None or value < below)


def check_int(
    name: str,
    value: Any,
    minimum: int | None = None,
    *,
    below: int | None = None,
    maximum: int | None = None,
    bound_name: str | None = None,
    optional: bool = False,
    numpy_ints: bool = False,
    meaning: str = "",
    error: type[ValueError] | type[TypeError] = ValueError,
) -> Any:
    """``value`` (as a Python int; ``None`` when ``optional`` and ``None``) if :func:`is_int`, else
    ``error``.

    Args:
        name: the argument's name, as the caller spells it.
        minimum, below, maximum: the range ``[minimum, below)`` or ``[minimum, maximum]``;
            any may be ``None``.
        bound_name: how the message names the upper bound (``cp_size`` in ``[0, cp_size=2)``).
        optional: ``None`` is accepted too (and returned).
        numpy_ints: numpy integers are accepted too (returned as ``int``).
        meaning: appended to the message: what the value means, or the fix.
        error: the ``ValueError`` subclass to raise, or ``TypeError`` where only the type is checked
            (Python's convention for an index of the wrong type).
    """
    if optional and value is None:
        return None
    if is_int(value, minimum, below, numpy_ints=numpy_ints) and (
        maximum is None or value <= maximum
    ):
        return int(value)
    bound = below if below is not None else maximum
    if bound is not None:
        upper = f"{bound_name}={bound}" if bound_name else f"{bound}"
        close = ")" if below is not None else "]"
        need = (
            f"an int in [{minimum}, {upper}{close}"
            if minimum is not None
            else f"an int <{'' if below is not None else '='} {upper}"
        )
    elif minimum is not None:
        need = f"an int >= {minimum}"
    else:
        need = "an int"
    raise error(f"{name}={value!r} must be {need}{' or None' if optional else ''}{meaning}")


def check_names(
    name: str,
    value: Any,
    *,
    non_empty: bool = False,
    distinct: bool = False,
    optional: bool = False,
) -> tuple[str, ...] | None:
    """``value`` as a tuple of key names (``None`` when ``optional`` and ``None``), else
    ``ValueError``.

    A key name is a non-empty ``str``; a bare string is refused rather than read as its
    characters. ``non_empty``: at least one name; ``distinct``: no name twice.
    """
    if optional and value is None:
        return None
    if (
        type(value) is tuple
        and not non_empty
        and not distinct
        and all(type(k) is str and k for k in value)
    ):
        return value  # the common case, on per-batch paths: no copy, no generic checks
    names = None if isinstance(value, str | bytes) else _as_tuple(value)
    ok = names is not None and all(isinstance(k, str) and k for k in names)
    if ok and distinct and len(set(names)) != len(names):  # type: ignore[arg-type]
        twice = next(k for i, k in enumerate(names) if k in names[:i])  # type: ignore[index]
        raise ValueError(
            f"{name}={value!r} must be a{' non-empty' if non_empty else ''} tuple of distinct key "
            f"names, but names {twice!r} twice; "
            f"pass each key once, e.g. {tuple(dict.fromkeys(names))!r}"  # type: ignore[arg-type]
        )
    ok = ok and (not non_empty or bool(names))
    if ok:
        return names
    need = (
        "a"
        + (" non-empty" if non_empty else "")
        + " tuple of"
        + (" distinct" if distinct else "")
        + " key names"
    )
    example = (value,) if isinstance(value, str) and value else ("input_ids",)
    raise ValueError(
        f"{name}={value!r} must be {need}{' or None' if optional else ''}, e.g. {example!r}"
    )


def check_index(name: str, value: Any, size: int, where: str) -> int:
    """``value`` as a position in ``[0, size)`` of ``where`` (e.g. ``"the cache at DIR, which holds
    6 samples"``); a negative one counts from the end, a numpy integer is taken as an int.

    ``TypeError`` (Python's convention for an index of the wrong type) naming ``name``, the value
    and its type; ``IndexError`` naming the value as given and the valid range.
    """
    if type(value) is not int:
        if not is_int(value, numpy_ints=True):
            raise TypeError(
                f"{name}={value!r} is of type {type(value).__name__}, not int; pass an index in "
                f"[-{size}, {size}) as an int"
            )
        value = int(value)
    pos = value + size if value < 0 else value
    if not 0 <= pos < size:
        raise IndexError(
            f"{name}={value} is out of range for {where}; pass an index in [-{size}, {size})"
        )
    return pos


def check_path(name: str, value: Any, expected: str) -> str:
    """``value`` as a ``str`` path when it is a non-empty ``str`` or ``os.PathLike``; else one line
    naming ``name``, the value, its type and ``expected`` (what to pass): ``TypeError``, or
    ``ValueError`` for an empty path."""
    path = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(path, str):
        raise TypeError(
            f"{name}={value!r} is of type {type(value).__name__}, not a path; pass {expected}"
        )
    if not path:
        raise ValueError(f"{name}={value!r} is empty; pass {expected}")
    return path


def _as_tuple(value: Any) -> tuple[Any, ...] | None:
    try:
        return tuple(value)
    except TypeError:
        return None
