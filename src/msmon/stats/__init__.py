"""The statistics of tensors: the op table (ops.py), their computation (engine.py, with the
C++ kernel in native/), the exact combination of pieces, sparse tensors (sparse.py) and the
replica check's fingerprints (fingerprint.py).

This package's own module imports nothing, so that `msmon.stats.ops` (the torch-free op table)
can be imported by the config and the offline tools without loading torch.
"""
