"""The offline CSV <-> TensorBoard conversion and the tolerant event reader (the live sinks are in output/sinks/)."""
