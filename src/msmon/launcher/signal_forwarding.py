"""The signals `msmon run` passes on to its job (torchrun, python, a launcher program), as torchrun
passes them on to its ranks: SIGTERM and SIGHUP always, SIGINT unless the job got it too.

Ctrl-C in a terminal sends SIGINT to the whole foreground process group: the launcher, torchrun
and every rank get it from the kernel, and a second SIGINT sent to torchrun while it is shutting
its ranks down would cut that shutdown short. A SIGINT sent to the launcher alone (`kill -INT`,
a scheduler that signals the process it started) reaches nobody else, and must be passed on, or
the ranks train on. The two are told apart by who sent the signal: the terminal's comes from
the kernel (si_code SI_KERNEL), a process's from kill() (SI_USER) or sigqueue (SI_QUEUE).

The signals are blocked while the job runs and read with sigtimedwait on a thread of the
launcher's, which alone sees that sender; where sigtimedwait does not exist (macOS), SIGINT is
left to the terminal, as before, and SIGTERM and SIGHUP are passed on by a handler.
"""

from __future__ import annotations

import signal
import subprocess
import threading
from types import TracebackType

SI_KERNEL = 0x80  # Linux: a signal the kernel sent itself (the terminal's Ctrl-C, its hang-up)
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
POLL_S = 0.1  # how often the waiting thread looks whether the job ended


def came_from_the_terminal(signum: int, si_code: int) -> bool:
    """Whether the job's own processes got this signal too: a SIGINT the kernel sent (the
    terminal's Ctrl-C reaches the whole foreground process group)."""
    return signum == signal.SIGINT and si_code == SI_KERNEL


class SignalForwarding:
    """While the `with` block runs, the signals FORWARDED reach `proc` as the module docstring says."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.forwarded: list[int] = []  # what was passed on, in order (for the tests and the log)
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._previous = {sig: signal.getsignal(sig) for sig in FORWARDED}

    def __enter__(self) -> SignalForwarding:
        if hasattr(signal, "sigtimedwait") and threading.current_thread() is threading.main_thread():
            signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)  # the thread below inherits the mask
            self._thread = threading.Thread(target=self._wait, name="msmon-signals", daemon=True)
            self._thread.start()
        else:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal reaches the job itself
            for sig in (signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, lambda signum, _frame: self._send(signum))
        return self

    def _wait(self) -> None:
        while not self._done.is_set():
            info = signal.sigtimedwait(FORWARDED, POLL_S)
            if info is not None and not came_from_the_terminal(info.si_signo, info.si_code):
                self._send(info.si_signo)

    def _send(self, signum: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)
            self.forwarded.append(signum)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._thread is not None:
            self._done.set()
            self._thread.join()
            for sig in FORWARDED:  # a signal still pending belonged to the job that ended: dropped
                signal.signal(sig, signal.SIG_IGN)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
