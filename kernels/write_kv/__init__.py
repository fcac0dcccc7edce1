"""write_kv kernel."""
