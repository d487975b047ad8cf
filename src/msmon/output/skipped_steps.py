"""The steps skip_step skipped, written where a restarted job's framework reads which to skip.

Two formats, both in the output root, both kept across restarts (appended to, never lost):

- Megatron's rerun tracker (`result_rejected_tracker.txt`; give it to Megatron with
  `--result-rejected-tracker-filename`): one line per skipped step, `ts=... node=... device=...
  jobID=... rank=R iteration=I status=second_rerun_reproducible result=skipped_by_msmon`. Megatron
  skips every iteration whose line has that status; its parser reads the status up to the line's
  last space, so nothing with a space follows it. Megatron skips iteration I before running the
  step that follows I-1 completed ones: msmon's step s (s steps trained before it) is I = s + 1.
- Lightning's `skip_batches.json` (SpikeDetection's `exclude_batches_path`): the JSON list of
  batch indices to leave out, rewritten whole (atomically) with the earlier ones kept; step s
  with g micro-batches per step is batches s*g to s*g+g-1.

Torch-free; written by the lowest voting rank, for the job.
"""

from __future__ import annotations

import datetime
import json
import os
import socket

from ..records.layout import LIGHTNING_SKIP_BATCHES, MEGATRON_SKIP_TRACKER
from .artifacts import write_artifact

MEGATRON_STATUS = "second_rerun_reproducible"  # Megatron's RerunValidationStatus that it always skips


def megatron_line(step: int, rank: int, device: str = "N/A") -> str:
    job = os.environ.get("SLURM_JOBID") or os.environ.get("SLURM_JOB_ID") or "N/A"
    return (
        f"ts={datetime.datetime.now().isoformat(sep='_')} node={socket.gethostname()} device={device} jobID={job} "
        f"rank={rank} iteration={step + 1} status={MEGATRON_STATUS} result=skipped_by_msmon\n"
    )


def batches_of(step: int, micro_batches: int) -> list[int]:
    return [step * micro_batches + i for i in range(micro_batches)]


def record_skip(output_base: str, step: int, rank: int, micro_batches: int) -> None:
    """Add skipped `step` (named by `rank`) to both files; OSError when they cannot be written."""
    os.makedirs(output_base, exist_ok=True)
    with open(os.path.join(output_base, MEGATRON_SKIP_TRACKER), "a", encoding="utf-8") as fh:
        fh.write(megatron_line(step, rank))
        fh.flush()
        os.fsync(fh.fileno())
    path = os.path.join(output_base, LIGHTNING_SKIP_BATCHES)
    try:
        with open(path, encoding="utf-8") as fh:
            earlier = [int(b) for b in json.load(fh)]
    except (OSError, ValueError, TypeError):
        earlier = []
    batches = sorted(set(earlier) | set(batches_of(step, max(micro_batches, 1))))
    write_artifact(output_base, LIGHTNING_SKIP_BATCHES, json.dumps(batches, indent=4) + "\n")
