"""What every router worker imports before it builds its Router, imported once, by the supervisor's
fork server (router/supervisor.py): workers and spares are forked from that process, so these
imports cost one process's seconds at start, not every worker's. They are most of a worker's start:
`from transformers import AutoTokenizer` alone is ~0.7 s of a core, far more on a loaded 16-core GPU
host, where eight workers and a spare imported it side by side.

Torch is kept out first (common/torch_free.py): transformers would otherwise import it, ~1.6 s and
~180 MB of this process, shared by every worker forked from it until their pages diverge.

NOTE: nothing here may start a thread that can hold a lock while the fork server forks, nor import
prometheus_client: it picks where its values live when first imported, from the variable each worker
sets for itself (router/metrics_env.py) — so not the router's own modules either (app, metrics)."""

from pdserve.common.torch_free import keep_torch_out

keep_torch_out()  # NOTE: before transformers' import below

import fastapi  # noqa: E402, F401
import pydantic  # noqa: E402, F401
import starlette.applications  # noqa: E402, F401
import uvicorn  # noqa: E402, F401
from transformers import AutoTokenizer  # noqa: E402, F401
