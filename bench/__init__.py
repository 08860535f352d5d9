"""Benchmarks: `pdserve bench offline|serve` and the overlap on/off study."""
