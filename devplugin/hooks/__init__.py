"""Example lifecycle hooks, runnable as `python3 -m devplugin.hooks.<name>`.

Both read the hook's JSON from stdin (see `devplugin.node.lifecycle.hooks`), are
safe to run any number of times, print what they found to stderr and exit
non-zero when a device is not fit to hand out (which keeps it quarantined
and makes the daemon retry).
"""
