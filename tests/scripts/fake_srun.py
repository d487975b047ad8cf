"""What `srun --ntasks N <command>` does on one node, for a machine without SLURM: start N
copies of the command at once, each with SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS and
SLURM_NODEID set as srun sets them, and exit with the first failing task's exit code."""

from __future__ import annotations

import os
import subprocess
import sys


def main() -> None:
    ntasks = int(sys.argv[1])
    command = sys.argv[sys.argv.index("--") + 1 :]
    tasks = []
    for task in range(ntasks):
        env = dict(os.environ, SLURM_PROCID=str(task), SLURM_LOCALID=str(task), SLURM_NTASKS=str(ntasks))
        env.update(SLURM_NODEID="0", SLURM_NNODES="1", SLURM_JOB_ID="4242", SLURM_STEP_ID="0")
        tasks.append(subprocess.Popen(command, env=env))
    codes = [task.wait() for task in tasks]
    sys.exit(next((code for code in codes if code), 0))


if __name__ == "__main__":
    main()
