"""The examples in the pure layer's docstrings run and print what they say (no TensorFlow)."""

import doctest
import importlib

import pytest

MODULES = [
    "hetero_cs.planning.balancer", "hetero_cs.planning.balancer_plans", "hetero_cs.planning.balancer_memory",
    "hetero_cs.planning.cost_model", "hetero_cs.planning.guard",
    "hetero_cs.planning.micro_batches",
    "hetero_cs.planning.monitor", "hetero_cs.planning.plan", "hetero_cs.planning.simulation",
    "hetero_cs.planning.solver", "hetero_cs.devices.workload",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples failed in {name}"
