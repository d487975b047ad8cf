"""What reads a finished run's output (analyse, convert, the results database and report).
Nothing here imports torch: these verbs run on a machine without it."""
