"""Alert rules evaluated on the host, anomaly dumps, and the cross-rank analyser."""
