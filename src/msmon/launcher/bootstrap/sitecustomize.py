"""msmon bootstrap: `msmon run` copies this file into a per-job directory that it puts first
on PYTHONPATH, so every Python process of the job imports it at start-up.

Ours runs first (`_msmon_boot`, copied beside this file: role detection, and in a training
worker a post-import hook that starts msmon's worker, `_msmon_start_worker`, once torch is
imported; torch is never imported here). Then the sitecustomize that would have run without
us (Debian's, a user's) runs, exactly once, and becomes `sys.modules["sitecustomize"]`.

This file is a template inside the msmon package: importing it from there does nothing.
"""

import os
import sys


def _msmon_is_bootstrap_dir(directory: str) -> bool:
    return all(
        os.path.isfile(os.path.join(directory or os.curdir, name))
        for name in ("bootstrap.json", "_msmon_boot.py", "sitecustomize.py")
    )


def _msmon_chain_next() -> None:
    """Run the next `sitecustomize` on sys.path that is not an msmon bootstrap (nested
    `msmon run` jobs stack bootstrap directories), as site.py would run it."""
    import importlib.machinery
    import importlib.util

    path = [p for p in sys.path if not _msmon_is_bootstrap_dir(p)]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module  # what `import sitecustomize` returns from now on
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the message site.py prints for a failing sitecustomize
        sys.stderr.write(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(exc).__name__}: {exc}\n")


def _msmon_start_worker(bootstrap_dir: str) -> None:
    """Once the script imported torch: monitor this worker (msmon.launcher.bootstrap.worker)."""
    from msmon.launcher.bootstrap.worker import start

    start(bootstrap_dir)


def _msmon_start() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    if not _msmon_is_bootstrap_dir(here) or getattr(sys, "_msmon_sitecustomize_ran", False):
        return  # the template inside the msmon package, or a second run in this process
    setattr(sys, "_msmon_sitecustomize_ran", True)  # noqa: B010 (sys has no such attribute to type-check)
    try:
        import _msmon_boot

        _msmon_boot.main(here, _msmon_start_worker)
    except Exception as exc:
        sys.stderr.write(f"msmon: bootstrap failed in pid {os.getpid()}; not monitored: {exc!r}\n")
    finally:
        _msmon_chain_next()


_msmon_start()
