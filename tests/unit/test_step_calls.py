"""benchmarks/step_calls.py counts every call of a package's functions, same-named ones included."""

from __future__ import annotations

import cProfile
import importlib.util
import os
import pstats
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from step_calls import calls_by_function  # noqa: E402

HOOKS = """
def make_pre(n):
    def pre_hook():
        return n
    return pre_hook


def make_tracker_pre():
    def pre_hook():
        return None
    return pre_hook


def run(pre_a, pre_b):
    for _ in range(44):
        pre_a()
    pre_b()
"""


def test_two_functions_of_one_name_in_one_file_are_both_counted(tmp_path):
    """27a2ae3's activations.py had two pre_hook closures (the targets' and the micro-step
    tracker's); the count kept one of them, 44 or 1 by the table's order, not 45."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "hooks.py").write_text(HOOKS)
    spec = importlib.util.spec_from_file_location("step_calls_hooks", package / "hooks.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    pre_a, pre_b = hooks.make_pre(1), hooks.make_tracker_pre()
    profiler = cProfile.Profile()
    profiler.enable()
    hooks.run(pre_a, pre_b)
    profiler.disable()
    inside, made = calls_by_function(pstats.Stats(profiler).stats, str(package) + os.sep)
    assert inside == {"hooks.py:pre_hook": 45, "hooks.py:run": 1}
    assert made == 45  # run's calls; the profiler's own disable() is a call from here, not from the package
