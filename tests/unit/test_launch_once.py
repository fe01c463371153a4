"""LaunchOnce: one launch serves many rows; a failed launch is not repeated for every row."""

import pytest

from nd_parallel.testing.launch import LaunchOnce


def test_result_is_computed_once_and_a_failure_is_remembered():
    calls = []

    def ok():
        calls.append("ok")
        return 42

    def broken():
        calls.append("broken")
        raise RuntimeError("2 ranks failed")

    once = LaunchOnce()
    assert once.get("a", ok) == 42 and once.get("a", ok) == 42
    for _ in range(3):
        with pytest.raises(RuntimeError, match="2 ranks failed"):
            once.get("b", broken)
    assert calls == ["ok", "broken"]
