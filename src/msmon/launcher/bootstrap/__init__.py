"""The in-job start-up of a job launched by `msmon run`: the bootstrap directory
(job_directory.py), the sitecustomize and role detection copied into it (sitecustomize.py,
boot.py: standard library only), and the worker's start once torch is imported (worker.py).

Light on import: nothing here is imported by the package itself."""
