"""The data pipeline's integer settings (``trainer_agent/data/settings.py``)."""

import numpy as np
import pytest

from trainer_agent.data.settings import int_setting, is_int


def test_an_integer_setting_is_an_integer_and_never_a_bool() -> None:
    assert [is_int(v) for v in (3, np.int64(3), True, 3.0, "3", None)] == [True, True, False, False, False, False]
    value = int_setting("window", np.int64(7))
    assert value == 7 and type(value) is int


@pytest.mark.parametrize("value, least, most, message", [
    (True, 1, None, "window must be an integer >= 1, got True"),
    (0, 1, None, "window must be an integer >= 1, got 0"),
    (-1, 0, None, "window must be an integer >= 0, got -1"),
    (9, 1, 8, "window must be <= 8 (a reason), got 9"),
])
def test_a_bad_integer_setting_is_a_value_error_naming_it(value, least, most, message) -> None:
    with pytest.raises(ValueError) as info:
        int_setting("window", value, least=least, most=most, why="a reason")
    assert str(info.value) == message
