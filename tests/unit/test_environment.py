"""The core reads the launcher's environment variables from msmon.system.environment, never from the launcher."""

import subprocess
import sys

from msmon.launcher.bootstrap import boot
from msmon.system import environment


def test_the_bootstrap_and_the_core_name_the_same_variable():
    assert boot.ENV_BOOTSTRAP_DIR == environment.ENV_BOOTSTRAP_DIR


def test_the_monitor_imports_nothing_of_the_launcher():
    code = "import sys, msmon.api; print(sorted(m for m in sys.modules if m.startswith('msmon.launcher')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_importing_msmon_imports_no_torch():
    code = "import sys, msmon; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
