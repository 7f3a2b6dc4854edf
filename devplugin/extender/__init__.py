"""The scheduler extender: a program of its own (`devplugin extender`) that
reads the cluster's caches and answers kube-scheduler's extender calls."""
