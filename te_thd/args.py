"""The one check of an integer argument, and the rule behind it.

:func:`is_int` is the rule (an ``int``, never a ``bool``, optionally within a range);
:func:`check_int` applies it to an argument and, when it fails, raises one line that
names the argument, the value and what it must be::

    check_int("shard_size", 0, 1, meaning=" (samples per shard)")
    # ValueError: shard_size=0 must be an int >= 1 (samples per shard)

Parsers of te_thd's own files (a manifest's counts, a shard header's fields) use
:func:`is_int` and word their own errors: there the value is damaged data, not an
argument the caller can fix.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["check_int", "is_int"]


def is_int(value: Any, minimum: int | None = None, below: int | None = None, *, numpy_ints: bool = False) -> bool:
    """Whether ``value`` is an int (not a bool; a numpy integer too with ``numpy_ints``) in ``[minimum, below)``."""
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
    error: type[ValueError] = ValueError,
) -> Any:
    """``value`` (as a Python int; ``None`` when ``optional`` and ``None``) if :func:`is_int`, else ``error``.

    Args:
        name: the argument's name, as the caller spells it.
        minimum, below, maximum: the range ``[minimum, below)`` or ``[minimum, maximum]``;
            any may be ``None``.
        bound_name: how the message names the upper bound (``cp_size`` in ``[0, cp_size=2)``).
        optional: ``None`` is accepted too (and returned).
        numpy_ints: numpy integers are accepted too (returned as ``int``).
        meaning: appended to the message: what the value means, or the fix.
        error: the ``ValueError`` subclass to raise.
    """
    if optional and value is None:
        return None
    if is_int(value, minimum, below, numpy_ints=numpy_ints) and (maximum is None or value <= maximum):
        return int(value)
    bound = below if below is not None else maximum
    if bound is not None:
        upper = f"{bound_name}={bound}" if bound_name else f"{bound}"
        close = ")" if below is not None else "]"
        need = f"an int in [{minimum}, {upper}{close}" if minimum is not None else f"an int <{'' if below is not None else '='} {upper}"
    elif minimum is not None:
        need = f"an int >= {minimum}"
    else:
        need = "an int"
    raise error(f"{name}={value!r} must be {need}{' or None' if optional else ''}{meaning}")
