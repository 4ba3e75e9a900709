"""The pure core: policy and bookkeeping (no torch, no I/O beyond config/checkpoint metadata, clock passed in)."""
