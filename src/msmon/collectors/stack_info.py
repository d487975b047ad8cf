"""stack_info: where each module of the model is called from, written once to `stack_info.csv`.

msprobe's output: `stack_info.csv` in the rank's directory, columns `module_name,stack_info`,
one row per module (`{chunk}:{name}`, `0:` for the model itself), the stack innermost frame
first, each frame `File {path}, line {n}, in {function}, \\n {code} \\n`. msmon records the
stack of each module's first forward call, by walking the interpreter's frames (no
`inspect.stack()`, which reads the source of every frame at every call); torch's and msmon's
own frames are left out, so what remains is the user's code. A module's hook removes itself
after that one call; at the end of the first step the file is written and every hook is gone,
so later steps cost nothing. A rank directory that already holds the file (append_output) is
left as it is.
"""

from __future__ import annotations

import csv
import io
import linecache
import os
import sys
from types import FrameType

import torch

from ..output.artifacts import write_artifact
from ..runtime.step_context import StepContext
from ..seams import guest_hooks
from .base import Collector
from .registry import register

FILE_NAME = "stack_info.csv"
MAX_FRAMES = 128
# torch is a package imported from files (its __file__ is set); msmon's folder is this file's
# parent's, found without importing the package above the collectors
_MSMON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SKIPPED = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, _MSMON_DIR + os.sep)


def capture_stack(frame: FrameType | None = None, limit: int = MAX_FRAMES) -> str:
    """The call stack from `frame` (the caller's by default) outwards, without torch's and
    msmon's frames, in msprobe's text form."""
    frame = frame if frame is not None else sys._getframe(1)
    parts: list[str] = []
    while frame is not None and len(parts) < limit:
        code = frame.f_code
        path = code.co_filename
        if not path.startswith(_SKIPPED):
            line = linecache.getline(path, frame.f_lineno).strip()
            parts.append(f"File {path}, line {frame.f_lineno}, in {code.co_name}, \n {line} \n")
        frame = frame.f_back
    return "".join(parts)


@register(key="stack_info", category="module", order=40, module_hooks=True, enabled=lambda cfg, ctx: cfg.stack_info)
class StackInfoCollector(Collector):
    name = "stack info"

    def __init__(self, ctx: StepContext) -> None:
        super().__init__(ctx)
        self.modules = [(m, f"{c}:{n}") for c, named in enumerate(ctx.names()[0]) for n, m in named.items()]
        self.stacks: dict[str, str] = {}
        self.path = os.path.join(ctx.log_dir, FILE_NAME) if ctx.log_dir else None
        self._hooks: dict[str, guest_hooks.GuestHandle] = {}

    def attach(self) -> None:
        if self.path is None or os.path.exists(self.path):
            return
        for module, name in self.modules:
            handle = guest_hooks.forward_pre_hook(module, self.guard(self._first_call(name)))
            self._hooks[name] = handle
            self.handles.append(handle)

    def _first_call(self, name: str):
        def pre_hook(module, args):
            handle = self._hooks.pop(name, None)
            if handle is None:
                return None
            handle.remove()  # one call per module: later forwards do not come here
            self.stacks[name] = capture_stack(sys._getframe(1))
            return None

        return pre_hook

    def end_step(self) -> None:
        if not self.stacks or self.path is None:
            return
        order = {name: i for i, (_, name) in enumerate(self.modules)}
        text = io.StringIO()
        writer = csv.writer(text, lineterminator="\n")
        writer.writerow(["module_name", "stack_info"])
        writer.writerows([name, self.stacks[name]] for name in sorted(self.stacks, key=order.__getitem__))
        write_artifact(os.path.dirname(self.path), FILE_NAME, text.getvalue())
        self.stacks = {}
        self.detach()  # modules not called in the first step are not waited for
        self._hooks.clear()
        self.enabled = False
