"""The test harness's rerun of a job whose gloo aborted in its interpreter teardown (conftest.py):
the rerun starts from what the first attempt found, its monitor output and its kernel cache
(MSMON_CACHE_DIR) both without what the aborted attempt wrote."""

from __future__ import annotations

import os
import subprocess

from conftest import GLOO_TEARDOWN_ABORT, _rerun_past_gloo_teardown_abort


def test_a_rerun_finds_the_kernel_cache_and_the_output_as_the_first_attempt_did(tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "out"
    cache.mkdir()
    out.mkdir()
    (cache / "kept").write_text("there before the job")
    seen: list[set[str]] = []

    def job(argv, **kwargs):
        seen.append(set(os.listdir(cache)) | set(os.listdir(out)))
        (cache / "msmon_stats.so").write_text("built")  # what a first use builds
        (out / "rank0").mkdir(exist_ok=True)
        aborted = len(seen) == 1
        return subprocess.CompletedProcess(argv, 134 if aborted else 0, "", GLOO_TEARDOWN_ABORT if aborted else "")

    env = {"MSMON_CACHE_DIR": str(cache), "MONITOR_OUTPUT_DIR": str(out)}
    result = _rerun_past_gloo_teardown_abort(job, ["torchrun", "job.py"], env=env)
    assert result.returncode == 0
    assert seen == [{"kept"}, {"kept"}]  # the rerun built the kernel again, as the first attempt did
