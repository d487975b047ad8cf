"""What one `msmon db` run did, in the lines it prints, and its progress bar."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # duckdb is optional and imported only where a database is opened
    pass


@dataclass
class LoadReport:
    database: str
    new: int = 0
    grown: int = 0
    reloaded: int = 0
    unchanged: int = 0
    missing: int = 0
    values: int = 0
    histograms: int = 0
    anomalies: int | None = None  # None: no dump changed, the table was kept
    skipped_lines: int = 0
    tb_duplicates: int = 0
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    run_lines: list[str] = field(default_factory=list)  # the run loaded and the others (records/runs.py)
    parquet_files: int = 0  # Parquet files added to the catalog (read in place: parquet_catalog.py)
    parquet_rows: int = 0  # their rows
    csv_in_parquet: int = 0  # CSV files left out: their ranks' statistics are in Parquet files
    unfinished_parquet: int = 0  # `.part-*.parquet.tmp` files of the run: not read
    gone: dict[str, int] = field(default_factory=dict)  # rank directory -> its files removed during the load

    def vanished(self, rank_dir: str) -> None:
        """A file of `rank_dir` was removed between the scan and its read (the directory was
        deleted or moved during the load): it is left out, and said once per directory."""
        self.gone[rank_dir] = self.gone.get(rank_dir, 0) + 1

    def lines(self) -> list[str]:
        out = self.run_lines + [
            f"msmon db: {self.new} new, {self.grown} grown, {self.reloaded} changed and reloaded, "
            f"{self.unchanged} unchanged files; {self.values:,} values and {self.histograms:,} histograms added"
            + ("" if self.anomalies is None else f"; {self.anomalies:,} anomaly records")
            + f" in {self.seconds:.1f} s -> {self.database}"
        ]
        if self.parquet_files:
            out.append(
                f"msmon db: {self.parquet_files:,} Parquet files ({self.parquet_rows:,} values) added to the "
                "catalog: the `metrics` view reads them where they are"
            )
        if self.csv_in_parquet:
            out.append(
                f"msmon db: {self.csv_in_parquet:,} CSV files left out: their ranks' values are in Parquet files"
            )
        if self.unfinished_parquet:
            out.append(
                f"msmon db: {self.unfinished_parquet:,} Parquet files not closed yet (.part-*.parquet.tmp: still "
                "written, or left by a rank that was killed) are not read"
            )
        if self.tb_duplicates:
            out.append(
                f"msmon db: {self.tb_duplicates:,} TensorBoard scalars left out: the same categories are "
                "in the CSV or Parquet files of their rank"
            )
        if self.skipped_lines:
            out.append(f"msmon db: {self.skipped_lines:,} malformed CSV lines skipped")
        if self.missing:
            out.append(f"msmon db: {self.missing} files in the database are no longer on disk (their rows are kept)")
        out += [
            f"msmon db: {d} disappeared during the load; {n} of its files skipped (load again to bring it in)"
            for d, n in sorted(self.gone.items())
        ]
        out += [f"msmon db: {p}" for p in self.problems[:20]]
        if len(self.problems) > 20:
            out.append(f"msmon db: ... and {len(self.problems) - 20} more problems")
        return out


def progress_bar(total: int, enabled: bool | None) -> Any:  # a tqdm bar, or _NoProgress
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoProgress()
    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="msmon db",
        file=sys.stderr,
        disable=None if enabled is None else not enabled,
        dynamic_ncols=True,
    )


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass
