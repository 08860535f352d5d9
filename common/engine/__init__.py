"""The device side: the model runner and its models and attention backends, the KV pools, sampling,
the overlap machinery (streams, FutureMap, pinned D2H), CUDA graphs, the batch builder, and the
engines (core.py: what every role's engine holds; engine.py: the colocated engine and its loops)."""
