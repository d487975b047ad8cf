"""The bottom layer: rank and world, the environment variables msmon reads, msmon's own
threads, and exit handling. Imports nothing else of msmon (one function-level exception:
distributed.pipeline_position)."""
