"""The first NaN/Inf's origin: the finiteness flags recorded per module input and output (collector.py)."""
