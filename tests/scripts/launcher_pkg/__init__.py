"""A training package run as `-m launcher_pkg.train_loader` (the launcher's module target)."""
