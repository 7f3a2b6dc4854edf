"""One daemon (in-process or as a process) against the kubelet simulators, over
real gRPC on unix sockets and a simulated sysfs tree."""
