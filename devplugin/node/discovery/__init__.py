"""Hardware discovery: each module reads one source and returns model objects."""

from devplugin.node.discovery.cdi import CdiReader
from devplugin.node.discovery.nvml import NvmlGpuSource, load_pynvml
from devplugin.node.discovery.scan import Discoverer, Roots

__all__ = ["CdiReader", "Discoverer", "NvmlGpuSource", "Roots", "load_pynvml"]
