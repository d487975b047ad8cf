"""`alert.on_nan: "stop"` and `alert.actions`: decided once per step from every rank's view, on
msmon's own group, and applied by every rank at the same step boundary (docs/actions.md).

board.py what this rank's readers of a step (the writer, the exchange threads) saw; vote.py the
ranks' gathers; decide.py the decision from every rank's alerts (torch-free); step_actions.py the
per-step round that ties them; one file per action: escalate.py, skip.py, stop.py, notify.py.
"""
