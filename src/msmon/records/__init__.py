"""The output vocabulary, torch-free: categories and row keys (rows.py), every file name and tag
(layout.py), runs (runs.py), a CSV cell's text (csv_cell.py) and TensorBoard's record framing
(tfrecord.py). Below anomaly/ and output/; the offline readers share it."""
