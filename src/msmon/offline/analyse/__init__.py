"""`msmon analyse`: where did it start? Orders every rank's anomalies in training time.

Reads each `anomaly.jsonl` (msmon) and `anomaly.json` (msprobe's layout) found under a
directory, however deep (several nodes' output directories may be copied into one), and sorts
the events by

    step, micro-step, place on the data path, pipeline position, call_id, rank

where the data path is forward activations < the loss < activation gradients < rank-local
gradients < after the reduction (reduced gradients, optimizer state, weights) (anomaly/
data_path.py), and the pipeline position is (vpp_stage, pp_stage) ascending in forward,
descending in backward (the last stage runs its backward first), and ascending after the
reduction (all stages step together: the order there is only a stable tie-break). An event that
covers the whole step (micro_step null: accumulated gradients, optimizer state) sorts after
every micro-step of its step. The first event, the first one on each rank, the first
non-finite origin (records of rule NanOrigin) and the kind of fault (kind.py: whose rank-local
values turned first) make the verdict.

Bad input never stops the analysis: a file that cannot be read or parsed is reported by name
and skipped; in a .jsonl file each malformed line (a torn last line after a crash, say) or
record (a field of the wrong type) is reported, counted and skipped, and the rest is kept.

Two files are written: msmon's report (the verdict, the first anomaly per rank, ...) and
msprobe's `anomaly_analyse.json` (msprobe_format), beside it.
"""
