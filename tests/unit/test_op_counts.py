"""Kernel-launching aten ops a monitored step adds on the accelerator path (MSMON_DEVICE_PATH=1,
no native kernel), counted by benchmarks/op_counts.py: the step-time statistics stay flat in the
number of parameters, and hooked activations are read in batches. Op counts are
deterministic, so they are asserted here; times never are."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import op_counts  # noqa: E402


@pytest.fixture(autouse=True)
def accelerator_path():
    with op_counts.accelerator_path():
        yield


@pytest.mark.parametrize("config", ["wg", "wg+mv+param", "wg+loss"])
def test_parameter_statistics_add_at_most_one_op_per_added_parameter(config, output_dir):
    slope = op_counts.slope(config)
    assert slope.params[64] - slope.params[16] == 96
    assert slope.per_param <= 1.0, slope


def test_activation_statistics_add_at_most_three_ops_per_hooked_activation(output_dir):
    slope = op_counts.slope("all_xy")
    assert slope.per_hooked is not None and slope.per_hooked <= 3.0, slope


def test_the_non_finite_origin_an_alert_rule_switches_on_reduces_each_distinct_activation_once(output_dir):
    """A block is a Linear and a ReLU (two parameters): two distinct activation tensors (one
    module's output is the next one's input) and their two gradients, one reduction each; the
    finiteness test runs once per step on all of them. It took 20 ops per parameter when each
    module's input and output, and each gradient, was reduced and tested apart (5 ops a flag)."""
    on, off = op_counts.slope("wg+alerts"), op_counts.slope("wg+alerts-origin")
    assert on.per_param - off.per_param <= 2.0 + 1e-9, (on, off)
