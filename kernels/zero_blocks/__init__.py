"""zero_blocks kernel."""
