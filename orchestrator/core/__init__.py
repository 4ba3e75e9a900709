"""The pure core: policy and bookkeeping (no torch, no I/O beyond config/checkpoint metadata, clock passed in)."""

from orchestrator.core.compiled import activate as _activate

_activate(__name__, __path__)      # MFS_COMPILED_CORE: this package's compiled modules first (compiled.py)
