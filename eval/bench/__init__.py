"""`mfs bench` and `mfs demo`: ShareGPT workloads replayed in real time, their metrics, curves and reports."""
