"""Weight gradients: rank-local (grad_unreduced) and consumed (grad_reduced) rows, the
gradient agreement between them, and the synchronised-gradient rows (sync.py)."""

from .collector import GradCollector

__all__ = ["GradCollector"]
