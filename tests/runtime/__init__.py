"""Real container runtimes: podman and runc run containers from the daemon's
CDI answers, and the image is built (CI installs them)."""
