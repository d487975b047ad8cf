"""torchrun as `msmon run` starts it (`python -m msmon.launcher.bootstrap.torchrun ARGS`): torchrun's
own main, unchanged, except when the job's ranks stopped on msmon's config error before training.

Then torchrun would add, to the one reason msmon gives, an error line per failed rank and a
30-line traceback with its ChildFailedError table, none of which says more. Here those are left
out and the job ends with the ranks' exit code; `msmon run`'s end-of-job line gives the reason
once (run_summary). A job failing for any other reason keeps torchrun's report as it is. Whether
the ranks stopped on a config error is read from their worker records in the bootstrap
directory, the records the launcher's summary reads.
"""

from __future__ import annotations

import logging
import os
import sys

from ..run_summary import config_errors, worker_records
from .boot import ENV_BOOTSTRAP_DIR

STOPPED_ON_CONFIG = 2  # the ranks' exit code (hooks.StopBeforeTraining)
AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"  # "failed (exitcode: ...)" per rank, and the like


def stopped_on_config_error() -> bool:
    bootstrap_dir = os.environ.get(ENV_BOOTSTRAP_DIR)
    return bootstrap_dir is not None and bool(config_errors(worker_records(bootstrap_dir)))


class _ConfigStopFilter(logging.Filter):
    """Drops the agent's lines about its workers ("failed (exitcode: 2)", "Sending process ...
    closing signal") when they ended on msmon's config stop."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not stopped_on_config_error()


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    logging.getLogger(AGENT_LOGGER).addFilter(_ConfigStopFilter())
    try:
        torchrun_main(argv)
    except ChildFailedError:
        if stopped_on_config_error():
            return STOPPED_ON_CONFIG
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
