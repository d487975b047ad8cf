"""`import msmon.auto`: monitor this process with one line, when the launcher cannot.

`msmon run` loads msmon through a `sitecustomize` on PYTHONPATH; `python -E`, `-I` and `-S`
skip it. Put `import msmon.auto` at the top of the training script instead: under
`msmon run` it uses that job's config and output directory, elsewhere the file named by
$MSMON_CONFIG or the built-in default config. Importing it twice, or in a process the
script's own workers start (DataLoader workers re-import the script), does nothing.
"""

from .launcher.bootstrap.worker import start_here

session = start_here()
