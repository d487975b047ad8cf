"""L2 features (collector.py: msprobe's four hooks; tensor_math.py: their math as pure tensor functions)."""
