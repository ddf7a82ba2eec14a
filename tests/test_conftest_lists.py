"""The suite's own bookkeeping: a ``slow_cells`` mark can only name cells its test has."""

import pytest

from conftest import check_slow_cells


def test_a_slow_cell_naming_no_cell_of_its_test_is_an_error():
    every = {p.name for p in __import__("pathlib").Path(__file__).parent.rglob("test_*.py")}
    declared = {"test_plan.py::test_x": {"a", "b"}}
    check_slow_cells(declared, {("test_plan.py::test_x", "a"), ("test_plan.py::test_x", "b")},
                     every)  # all present: fine
    with pytest.raises(pytest.UsageError, match=r"does not have: test_plan.py::test_x\[b\]"):
        check_slow_cells(declared, {("test_plan.py::test_x", "a")}, every)
    check_slow_cells(declared, set(), {"test_plan.py"})  # a partial run checks nothing
