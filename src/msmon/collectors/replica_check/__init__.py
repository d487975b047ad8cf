"""The replica check (collector.py): data-parallel replicas compared by bit-exact fingerprints."""
