"""Speculative decoding's parts: proposers (ngram.py) and the exact verification (verify.py).

Not yet wired into the decode loop: see docs/architecture.md, "Speculative decoding"."""
