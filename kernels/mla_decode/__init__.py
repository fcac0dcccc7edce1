"""mla_decode kernel."""
