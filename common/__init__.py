"""Engine core shared by the prefill and decode roles.

Kept light on purpose: importing `pdserve.common` must not import torch or model code, so the
router (which imports the torch-free protocol modules) stays cheap to start.
"""

from pdserve.common import transformers_index

# Every pdserve process passes here before it imports transformers: its model index is then read
# from the cache instead of from ~1,700 files (common/transformers_index.py).
transformers_index.install()
