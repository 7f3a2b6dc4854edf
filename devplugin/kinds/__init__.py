"""Device kinds as wings: what each kind alone knows, and the registry.

Pure: below policy, above the wire objects and the plain data.
"""
