"""Keeping devices safe to hand out: health, hooks, cleanup and its checkpoint."""
