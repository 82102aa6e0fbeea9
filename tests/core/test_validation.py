"""``all_ints``: the element-type check of token-id lists that the server, the LLM API and the engine share."""
import enum

from macattn.core.validation import all_ints


class Colour(enum.IntEnum):
    RED = 1


def test_all_ints_is_isinstance_int_without_bool_for_every_element():
    assert all_ints([]) and all_ints([0, 5, 1 << 70]) and all_ints((3, Colour.RED))
    for bad in ([1, True], [False], [1, 2.0], (1, "2"), [1, None], [[1]]):
        assert not all_ints(bad), bad
