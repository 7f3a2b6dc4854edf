"""Hardware discovery: each module reads one source and returns model objects."""

from devplugin.discovery.cdi import CdiReader
from devplugin.discovery.nvml import NvmlGpuSource, load_pynvml
from devplugin.discovery.scan import Discoverer, Roots

__all__ = ["CdiReader", "Discoverer", "NvmlGpuSource", "Roots", "load_pynvml"]
