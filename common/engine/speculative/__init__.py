"""Speculative decoding's device side: proposers (ngram.py), the exact verification (verify.py) and the
verify step's engine half (step.py); the scheduling half is common/scheduling/speculation.py (see
docs/architecture.md, "Speculative decoding")."""
