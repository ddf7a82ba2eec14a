"""The suite's own bookkeeping: the slow-by-node-id list can only name tests that exist."""

import pytest

from conftest import BUDGET_SLOW, check_budget_slow


def test_a_slow_list_entry_naming_no_test_is_an_error(tmp_path):
    every = {p.name for p in __import__("pathlib").Path(__file__).parent.rglob("test_*.py")}
    check_budget_slow(set(BUDGET_SLOW), every)  # all present: fine
    with pytest.raises(pytest.UsageError, match="do not exist: test_plan.py::test_plan_work"):
        check_budget_slow(set(BUDGET_SLOW) - {"test_plan.py::test_plan_work_is_bounded_in_the_depth"},
                          every)
    check_budget_slow(set(), {"test_plan.py"})  # a partial run checks nothing
