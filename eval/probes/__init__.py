"""One-off measurements of the engine and the core (developer probes; nothing in the product imports them)."""
