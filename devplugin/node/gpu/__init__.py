"""The GPU wing's node side: how GPUs are served."""
