"""The serving edge: HTTP, serving loops over an engine, metrics, tokenizer, CLI, the engine factory."""
