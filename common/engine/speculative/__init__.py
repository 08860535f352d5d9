"""Speculative decoding's device side: proposers (ngram.py; draft.py with draft_runner.py, a draft model
and its own KV pool), the exact verification (verify.py) and the verify step's engine half (step.py); the
scheduling half is common/scheduling/speculation.py, the proposer interface common/scheduling/proposer.py
(see docs/architecture.md, "Speculative decoding")."""
