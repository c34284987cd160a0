"""The one integer-argument check and the one key-names check (te_thd.args): the rules, property-tested, and their messages."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from te_thd.args import check_int, check_names, is_int

VALUES = st.one_of(
    st.integers(-50, 50), st.booleans(), st.floats(allow_nan=True), st.none(), st.text(max_size=2),
    st.integers(-50, 50).map(np.int64), st.sampled_from([np.bool_(True), np.float32(1.0)]),
)  # fmt: skip
BOUNDS = st.one_of(st.none(), st.integers(-10, 10))


@given(value=VALUES, minimum=BOUNDS, below=BOUNDS, numpy_ints=st.booleans())
def test_is_int_is_an_int_never_a_bool_within_the_range(value, minimum, below, numpy_ints) -> None:
    want = (
        (type(value) is int or (numpy_ints and isinstance(value, np.integer)))
        and (minimum is None or value >= minimum)
        and (below is None or value < below)
    )
    assert is_int(value, minimum, below, numpy_ints=numpy_ints) == bool(want)


@given(value=VALUES, minimum=BOUNDS, maximum=BOUNDS)
def test_check_int_returns_a_python_int_or_raises_one_line_naming_the_value(
    value, minimum, maximum
) -> None:
    ok = is_int(value, minimum, numpy_ints=True) and (maximum is None or value <= maximum)
    if ok:
        got = check_int("n", value, minimum, maximum=maximum, numpy_ints=True)
        assert type(got) is int and got == value
        return
    with pytest.raises(ValueError) as info:
        check_int("n", value, minimum, maximum=maximum, numpy_ints=True, meaning=" (the fix)")
    message = str(info.value)
    assert message.startswith(f"n={value!r} must be an int") and message.endswith(" (the fix)")
    assert "\n" not in message


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"value": 0, "minimum": 1}, "x=0 must be an int >= 1"),
        (
            {"value": 3, "minimum": 0, "below": 3, "bound_name": "cp_size"},
            r"x=3 must be an int in [0, cp_size=3)",
        ),
        ({"value": 11, "minimum": 0, "maximum": 10}, "x=11 must be an int in [0, 10]"),
        ({"value": 2.0}, "x=2.0 must be an int"),
        ({"value": "2", "optional": True}, "x='2' must be an int or None"),
        ({"value": True, "minimum": 0}, "x=True must be an int >= 0"),
    ],
)
def test_check_int_messages(kwargs, message) -> None:
    with pytest.raises(ValueError) as info:
        check_int("x", **kwargs)
    assert str(info.value) == message


def test_check_int_accepts_none_when_optional_and_raises_the_callers_error() -> None:
    assert check_int("x", None, 1, optional=True) is None

    class Mine(ValueError):
        pass

    with pytest.raises(Mine):
        check_int("x", None, 1, error=Mine)


NAMES = st.one_of(
    st.lists(st.sampled_from(["a", "b", "c", "", 1, None]), max_size=4).map(tuple),
    st.lists(st.sampled_from(["a", "b"]), max_size=3),
    st.sampled_from(["a", "", b"a", 3, None]),
)


@given(value=NAMES, non_empty=st.booleans(), distinct=st.booleans(), optional=st.booleans())
def test_check_names_returns_a_tuple_of_names_or_raises_one_line_naming_the_value(
    value, non_empty, distinct, optional
) -> None:
    """A tuple (or list) of non-empty strings is returned as a tuple; a bare string, a non-name, an
    empty tuple with ``non_empty`` or a repeat with ``distinct`` raise naming the argument and value."""
    seq = isinstance(value, tuple | list)
    want_ok = (optional and value is None) or (
        seq and all(isinstance(k, str) and k for k in value)
        and (not non_empty or len(value) > 0) and (not distinct or len(set(value)) == len(value))
    )  # fmt: skip
    if want_ok:
        got = check_names("keys", value, non_empty=non_empty, distinct=distinct, optional=optional)
        assert got == (None if value is None else tuple(value))
        return
    with pytest.raises(ValueError) as e:
        check_names("keys", value, non_empty=non_empty, distinct=distinct, optional=optional)
    msg = str(e.value)
    assert msg.startswith(f"keys={value!r} must be a") and "\n" not in msg and "e.g. (" in msg


def test_check_names_suggests_the_tuple_of_a_bare_string() -> None:
    with pytest.raises(
        ValueError,
        match=r"^disk_keys='hidden' must be a non-empty tuple of key names, e\.g\. \('hidden',\)$",
    ):
        check_names("disk_keys", "hidden", non_empty=True)
