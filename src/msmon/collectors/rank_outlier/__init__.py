"""AnomalyRankOutlier: the data-parallel ranks compared each recorded step (collector.py says how)."""
