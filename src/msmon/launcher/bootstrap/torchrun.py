"""torchrun as `msmon run` starts it (`python -m msmon.launcher.bootstrap.torchrun ARGS`): torchrun's
own main, unchanged, except when the job's ranks stopped on a decision of msmon's: a config error
before training (exit code 2), or a stop a rank recorded (system/decision.py: `alert.on_nan:
"stop"`, exit code 3, ...).

Then torchrun would add, to the one line msmon gives, an error line per failed rank ("failed
(exitcode: 3)", a rank it ended with SIGTERM) and a 30-line traceback with its ChildFailedError
table, none of which says more. Here those are left out and the job ends with msmon's exit code
(system/exit_codes.py); `msmon run`'s end-of-job lines give the reason once (run_summary). A job
failing for any other reason keeps torchrun's report as it is. Whether the ranks stopped on
msmon's decision is read from the bootstrap directory, where the launcher's summary reads it:
the ranks' worker records (a config error) and decision records.
"""

from __future__ import annotations

import logging
import os
import sys

from ...system.decision import choose, read_decisions
from ...system.exit_codes import CONFIG_ERROR
from ..run_summary import config_errors, worker_records
from .boot import ENV_BOOTSTRAP_DIR

STOPPED_ON_CONFIG = CONFIG_ERROR  # the ranks' exit code (hooks.StopBeforeTraining)
AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"  # "failed (exitcode: ...)" per rank, and the like


def stopped_on_config_error() -> bool:
    bootstrap_dir = os.environ.get(ENV_BOOTSTRAP_DIR)
    return bootstrap_dir is not None and bool(config_errors(worker_records(bootstrap_dir)))


def decided_code() -> int | None:
    """The exit code of the stop the ranks recorded (system/decision.py), or None."""
    bootstrap_dir = os.environ.get(ENV_BOOTSTRAP_DIR)
    decision = choose(read_decisions(bootstrap_dir)) if bootstrap_dir else None
    return decision.code if decision is not None else None


def stopped_by_msmon() -> bool:
    return decided_code() is not None or stopped_on_config_error()


class _ConfigStopFilter(logging.Filter):
    """Drops the agent's lines about its workers ("failed (exitcode: 2)", "Sending process ...
    closing signal") when they ended on msmon's decision."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not stopped_by_msmon()


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    logging.getLogger(AGENT_LOGGER).addFilter(_ConfigStopFilter())
    try:
        torchrun_main(argv)
    except ChildFailedError:
        code = decided_code()
        if code is not None:
            return code
        if stopped_on_config_error():
            return STOPPED_ON_CONFIG
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
