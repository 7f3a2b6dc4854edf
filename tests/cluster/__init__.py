"""A cluster: the API server imitation with one or more daemons, the scheduler
extender, DRA drivers and the chart."""
