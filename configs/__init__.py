"""Model/cache configs (models/*.yaml) and tuned kernel configs (tuning/<op>/<device>.json), shipped as package data."""
