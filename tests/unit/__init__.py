"""Pure units: policy, config, parsers and single objects driven in-process
with fake clocks; nothing listens and no daemon starts."""
