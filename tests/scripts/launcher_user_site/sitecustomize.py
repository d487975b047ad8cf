"""A user's own sitecustomize: msmon's bootstrap must still run it, in every process."""

import os

_directory = os.environ.get("LAUNCHER_TEST_PIDS")
if _directory:
    open(os.path.join(_directory, f"user-site-{os.getpid()}"), "w").close()
