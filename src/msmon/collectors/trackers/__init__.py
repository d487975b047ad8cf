"""The tracker formats' lanes (wandb, mlflow): gathered across the ranks, logged by one (collector.py)."""
