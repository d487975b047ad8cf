"""Compile fused_stats.cpp with the system C++ compiler into a per-user cache, once per machine.

The kernel is plain C++ (no torch or Python header), so one compiler call builds it in a second
or two, without ninja. The file name is keyed on the source, the flags and the compiler's
version, not on torch: the C ABI does not depend on torch's. Ranks starting together (on one
node or on nodes sharing a home directory) build it once: the first takes a file lock and
compiles into a temporary file that is renamed into place; the others wait for the lock, then
find the file. Without a compiler, a build of the same source and flags made elsewhere (by
another compiler, say on a login node) is used if there is one.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import IO, Optional

try:
    import fcntl
except ImportError:  # not POSIX: no lock, the rename into place stays atomic
    fcntl = None  # type: ignore[assignment]

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fused_stats.cpp")
# portable: no -march (a shared cache may serve nodes with different CPUs); AVX2 is picked at run time
FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp-simd", "-pthread")
CACHE_ENV = "MSMON_CACHE_DIR"
LOCK_TIMEOUT_S = 600.0  # how long a rank waits for another one's build before giving up
_COMPILERS = ("c++", "g++", "clang++")


class BuildError(Exception):
    """Why the kernel is not available, in one line."""


class NoCompiler(BuildError):
    """No C++ compiler, and no build of this source from elsewhere in the cache."""


@dataclass
class Found:
    path: str
    compiled: bool  # compiled by this process (False: found, possibly after waiting for another's build)
    seconds: float = 0.0  # the compiler's wall time when compiled here


def cache_dir() -> str:
    """$MSMON_CACHE_DIR, else $XDG_CACHE_HOME/msmon, else ~/.cache/msmon."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(base), "msmon")


def compiler() -> Optional[list[str]]:
    """$CXX (split like a shell would; nothing else is tried when it is set), else the first of
    c++, g++, clang++ on PATH."""
    explicit = os.environ.get("CXX", "").strip()
    if explicit:
        return shlex.split(explicit)
    for name in _COMPILERS:
        path = shutil.which(name)
        if path:
            return [path]
    return None


def compiler_version(cmd: list[str]) -> Optional[str]:
    """The compiler's `--version` text and the options given with it in $CXX (they may change
    the code), or None when it does not run."""
    try:
        done = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    version = done.stdout.strip()
    return " ".join([version, *cmd[1:]]) if done.returncode == 0 and version else None


def source_key(source: bytes, flags: tuple[str, ...] = FLAGS) -> str:
    return hashlib.sha256(source + b"\0" + " ".join(flags).encode()).hexdigest()[:16]


def library_name(source: bytes, version: str, flags: tuple[str, ...] = FLAGS) -> str:
    """fused_stats-<source and flags>-<compiler>.so: a change of any of the three is a new file."""
    return f"fused_stats-{source_key(source, flags)}-{hashlib.sha256(version.encode()).hexdigest()[:8]}.so"


def _read_source() -> bytes:
    try:
        with open(SOURCE, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise BuildError(f"cannot read {SOURCE}: {exc.strerror or exc}") from None


def expected_path() -> Optional[str]:
    """Where this source, these flags and this machine's compiler put the library; None
    without a compiler."""
    cmd = compiler()
    version = compiler_version(cmd) if cmd else None
    return None if version is None else os.path.join(cache_dir(), library_name(_read_source(), version))


def find_or_build(allow_build: bool = True) -> Found:
    """The library for this source: from the cache, or compiled now (allow_build) under the
    cache's file lock. Raises BuildError (NoCompiler) with the reason in one line."""
    source = _read_source()
    directory = cache_dir()
    cmd = compiler()
    version = compiler_version(cmd) if cmd else None
    if cmd is None or version is None:
        elsewhere = sorted(
            glob.glob(os.path.join(glob.escape(directory), f"fused_stats-{source_key(source)}-*.so")),
            key=os.path.getmtime,
        )
        if elsewhere:
            return Found(elsewhere[-1], compiled=False)
        what = (
            f"CXX={os.environ['CXX']!r} does not run"
            if os.environ.get("CXX", "").strip()
            else f"none of {', '.join(_COMPILERS)} on PATH"
        )
        raise NoCompiler(f"no C++ compiler ({what})")
    path = os.path.join(directory, library_name(source, version))
    if os.path.exists(path):
        return Found(path, compiled=False)
    if not allow_build:
        raise BuildError(f"not built yet: {path}")
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise BuildError(f"cannot create the cache directory {directory}: {exc.strerror or exc}") from None
    with _file_lock(path + ".lock"):
        if os.path.exists(path):  # another rank built it while this one waited
            return Found(path, compiled=False)
        seconds = _compile(cmd, source, path)
    return Found(path, compiled=True, seconds=seconds)


def _compile(cmd: list[str], source: bytes, path: str) -> float:
    """Compile the source (fed on stdin: exactly the bytes that were hashed) into a temporary
    file beside `path`, then rename it into place, so nobody ever loads half a library."""
    start = time.perf_counter()
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=os.path.basename(path) + ".", suffix=".tmp")
        os.close(fd)
        done = subprocess.run(
            [*cmd, *FLAGS, "-x", "c++", "-", "-o", tmp], input=source, capture_output=True, timeout=LOCK_TIMEOUT_S
        )
        if done.returncode != 0:
            lines = done.stderr.decode(errors="replace").strip().splitlines()
            errors = [line for line in lines if "error" in line] or lines or ["no output"]
            raise BuildError(f"{' '.join(cmd)} failed (exit {done.returncode}): {errors[0].strip()}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"{' '.join(cmd)} could not build {path}: {exc}") from None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    return time.perf_counter() - start


class _file_lock:
    """An exclusive flock on `path`, waited for up to LOCK_TIMEOUT_S (a crashed holder's lock is
    released by the kernel)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fh: Optional[IO[str]] = None

    def __enter__(self) -> _file_lock:
        if fcntl is None:
            return self
        try:
            self.fh = fh = open(self.path, "a")
        except OSError as exc:
            raise BuildError(f"cannot open the lock {self.path}: {exc.strerror or exc}") from None
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    fh.close()
                    raise BuildError(f"waited {LOCK_TIMEOUT_S:.0f} s for another process's build ({self.path})")
                time.sleep(0.05)
            except OSError:  # a file system without locks (ENOLCK): build anyway, the rename stays atomic
                return self

    def __exit__(self, *exc: object) -> None:
        if self.fh is not None:
            self.fh.close()  # releases the lock
