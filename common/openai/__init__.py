"""OpenAI's formats: request validation (api.py), responses (format.py), Batch files (run_batch.py).
Torch-free: the router imports it."""
