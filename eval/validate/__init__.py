"""Validation of the simulator: real runs measured and set against their simulation."""
