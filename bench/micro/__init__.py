"""Micro-benchmarks: one part alone (the scheduler's pick, the limiter stores, the image
libraries), in this process."""
