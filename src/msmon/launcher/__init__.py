"""The zero-code launcher: `msmon run`, `msmon struct`, `msmon analyse` (cli), the per-job
bootstrap that loads msmon into an unmodified training script (bootstrap, sitecustomize,
boot), and what runs inside each training worker (worker)."""
