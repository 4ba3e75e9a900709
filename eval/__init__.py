"""Evaluation: ShareGPT workloads, the independent-deployment baseline, benchmarks and notebooks."""
