"""The environment variables msmon's core reads, in one module that imports nothing.

The launcher (`msmon run`) sets ENV_BOOTSTRAP_DIR in every process of a job; launcher/bootstrap/boot.py
keeps its own copy of the name, because it is copied into the job's bootstrap directory and
runs there before msmon's package can be imported (tests check the two agree).
"""

ENV_BOOTSTRAP_DIR = "MSMON_BOOTSTRAP_DIR"  # set under `msmon run`: the launcher prints the cost lines
ENV_DYNAMIC_MONITOR = "DYNAMIC_MONITOR"  # msprobe's dynamic mode: record nothing until dynamic_on
ENV_JOB_MODE = "MSMON_JOB_MODE"  # under the launcher: "run" or "struct" (`msmon struct` sets print_struct itself)
