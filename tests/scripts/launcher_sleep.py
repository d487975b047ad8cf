"""A job that only waits: touches the file it is given (it runs), then sleeps."""

import pathlib
import sys
import time

pathlib.Path(sys.argv[1]).touch()
time.sleep(float(sys.argv[2]))
