"""The bottom layer: rank and world, the environment variables msmon reads, msmon's own
threads, exit handling, and the short repr of error messages. Imports nothing else of msmon
(stop.py names the collectors' StructCollector for type checkers only)."""
