"""The monitor the hooks attach, as they see it. The instrumentors sit below the api, so they
never build its TrainerMon themselves: whoever creates the Session (the launcher's in-job
start-up, `import msmon.auto`) gives it a factory, and the attach sequence (attach.py) calls
that factory with the session's config file."""

from __future__ import annotations

from typing import Any, Callable, Protocol


class AttachedMonitor(Protocol):
    """What the hooks use of a monitor they attach (the api's TrainerMon is one)."""

    records_modules: bool  # whether it hooks its models' modules (a model's activations are recorded once)

    @property
    def rank(self) -> int: ...

    @property
    def active(self) -> bool:
        """Whether this rank records (the config's module_ranks)."""

    @property
    def attached(self) -> bool: ...

    @property
    def models(self) -> list[Any]: ...

    @property
    def params(self) -> list[Any]: ...

    @property
    def adapter(self) -> Any: ...

    @property
    def optimizer(self) -> Any: ...

    @property
    def log_dir(self) -> str | None: ...

    @property
    def output_base(self) -> str: ...

    @property
    def output(self) -> Any: ...

    @property
    def steps_recorded(self) -> int: ...

    def set_monitor(self, model: Any, optimizer: Any) -> None: ...

    def rebuild_collectors(self) -> None: ...

    def close(self) -> None: ...


# builds one monitor from a config file path; the attach sequence then attaches it
MonitorFactory = Callable[[str], AttachedMonitor]
