"""Memory readings: the device, the host, and the peak of a step."""
