"""What `srun --ntasks N --kill-on-bad-exit <command>` does on one node, for a machine without
SLURM: start N copies of the command at once, each with SLURM_PROCID, SLURM_LOCALID,
SLURM_NTASKS and SLURM_NODEID set as srun sets them (and a SLURM_JOB_ID of its own per run),
and exit with the first failing task's exit code. As soon as one task fails the others are
ended (SIGTERM, then SIGKILL after 10 s): they would otherwise wait for the failed one in
torch.distributed until gloo's timeout (30 minutes). A SIGTERM or SIGINT to this process is
passed on to the tasks, as srun passes it on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def main() -> None:
    ntasks = int(sys.argv[1])
    command = sys.argv[sys.argv.index("--") + 1 :]
    tasks: list[subprocess.Popen] = []
    for task in range(ntasks):
        env = dict(os.environ, SLURM_PROCID=str(task), SLURM_LOCALID=str(task), SLURM_NTASKS=str(ntasks))
        env.update(SLURM_NODEID="0", SLURM_NNODES="1", SLURM_JOB_ID=str(os.getpid()), SLURM_STEP_ID="0")
        tasks.append(subprocess.Popen(command, env=env))

    def forward(signum: int, _frame: object) -> None:
        for running in tasks:
            if running.poll() is None:
                running.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while True:
        codes = [task.poll() for task in tasks]
        failed = next((code for code in codes if code), None)
        if failed is not None:
            for number, (task, code) in enumerate(zip(tasks, codes)):
                if code is None:  # SIGTERM first: `msmon run` passes it on to its job
                    print(f"fake_srun: a task exited with {failed}: ending task {number}", file=sys.stderr)
                    task.terminate()
            for task in tasks:
                try:
                    task.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    task.kill()
                    task.wait()
            sys.exit(failed)
        if all(code is not None for code in codes):
            sys.exit(0)
        time.sleep(0.1)


if __name__ == "__main__":
    main()
