"""Where statistics go: TensorBoard, CSV, in-memory API. Sinks know nothing about torch modules."""

from .api_sink import ApiSink
from .base import Sink
from .csv_sink import CsvSink
from .tensorboard_sink import TensorBoardSink

__all__ = ["Sink", "CsvSink", "ApiSink", "TensorBoardSink", "make_sinks"]


def make_sinks(formats: list[str], log_dir: str, ndigits: int, step_count_per_record: int) -> list[Sink]:
    """Build the sinks named in the config's `format`."""
    sinks: list[Sink] = []
    for fmt in formats:
        if fmt == "csv":
            sinks.append(CsvSink(log_dir, ndigits, step_count_per_record))
        elif fmt == "tensorboard":
            sinks.append(TensorBoardSink(log_dir))
        elif fmt == "api":
            sinks.append(ApiSink())
    return sinks
