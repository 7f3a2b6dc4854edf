"""Hardware discovery: each module reads one source and returns model objects."""

from devplugin.discovery.nvml import NvmlGpuSource, load_pynvml
from devplugin.discovery.scan import Discoverer, Roots

__all__ = ["Discoverer", "NvmlGpuSource", "Roots", "load_pynvml"]
