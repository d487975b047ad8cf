"""Offline conversion of monitor output, rank by rank: CSV -> TensorBoard and TensorBoard -> CSV.

CSV -> TensorBoard reads each rank directory's `{category}_{first}-{last}.csv` files and writes
an events file per rank. Tags are msmon's live ones by default
(`{vpp}:{name}[:{micro}]/rank{r}/{category}_{op}`, collectives `{op}@{site}/rank{r}/{pre|post}_{op}`,
mg_direction `{vpp}:{name}/rank{r}/mg_direction_{op}`), in `<out>/<rank directory name>/`; or
msprobe's csv2tensorboard layout (`<out>/rank{r}/{category}/`, tags `vp{vpp}:{name}[:micro{m}]/{op}`).
Values are written as float64 tensor scalars, which TensorBoard shows like any scalar and which
keep every digit of the CSV (`float32=True`: TensorBoard's classic 32-bit simple values, what
the live sink writes and what readers of `EventAccumulator.Scalars` expect).

TensorBoard -> CSV reads a rank directory with tensorboard's own EventAccumulator (nothing
sampled away; its restart handling drops what a resumed run superseded) and writes the CSV
files the live sink would have written: same names, header, row order, windows of
`step_count_per_record` steps and rounding to `ndigits` (both read from the rank's config.json
unless given). A run converted CSV -> TensorBoard -> CSV gives back its CSV files.
"""
