"""converters.readahead: values come back in order, loaded ahead up to a byte budget."""

import threading

import pytest

from converters.readahead import ReadAhead

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)


def test_loads_in_order_and_stays_within_the_byte_budget():
    sizes = {f"p{i}": 10 for i in range(20)}
    loaded, taken, lock = [], [], threading.Lock()
    most_ahead = [0]

    def load(name):
        with lock:
            loaded.append(name)
            most_ahead[0] = max(most_ahead[0], len(loaded) - len(taken))
        return name.upper()

    with ReadAhead(sizes, load, sizes.get, ahead_bytes=35) as ra:
        for name in sizes:
            assert ra(name) == name.upper()
            with lock:
                taken.append(name)
    assert loaded == list(sizes)
    assert most_ahead[0] <= 5  # 35 bytes of 10-byte values: 4 queued, plus one being handed back


def test_a_value_bigger_than_the_budget_still_loads():
    with ReadAhead(["big", "small"], str.upper, {"big": 100, "small": 1}.get, ahead_bytes=10) as ra:
        assert ra("big") == "BIG" and ra("small") == "SMALL"


def test_out_of_order_request_is_refused():
    with (
        ReadAhead(["a", "b"], str.upper, lambda n: 1) as ra,
        pytest.raises(AssertionError, match="expected a"),
    ):
        ra("b")
