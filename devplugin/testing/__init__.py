"""Simulators and fakes for the demo and the tests: the kubelet, sysfs trees, NVML.

Production modules never import this package (an import-linter contract in
`make lint` enforces it); only the entry points do: `devplugin demo`, and the
fixture-driven NVML behind `--nvml-fixture`.
"""
