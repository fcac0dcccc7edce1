"""sparse_mla_decode kernel."""
