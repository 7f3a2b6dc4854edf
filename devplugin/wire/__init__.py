"""The objects devplugin puts on the wire, one home each, shared by the
daemon and the extender.

Nothing here imports the daemon (node/, cluster/, front-ends): the extender
loads these definitions without loading the daemon, which an import
contract in pyproject.toml keeps true.
"""
