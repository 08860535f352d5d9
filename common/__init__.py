"""Engine core shared by the prefill and decode roles.

Kept light on purpose: importing `pdserve.common` must not import torch or model code, so the
router (which imports the torch-free protocol modules) stays cheap to start.
"""
