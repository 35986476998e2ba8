"""Memory readings: the device (pynvml, TensorFlow's allocator), the host (psutil, cgroup,
rlimit, TensorFlow's CPU cap) and the peak of a step.
"""
