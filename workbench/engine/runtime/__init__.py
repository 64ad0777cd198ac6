"""What runs the models: device backends, KV caches and saved prefix caches, the kernels'
warm-up, profiling spans, the CPU cores' share, and the elementwise formulas the models
and backends share."""
