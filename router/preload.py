"""What every router worker imports before it builds its Router, imported once, by the supervisor's
fork server (router/supervisor.py): workers and spares are forked from that process, so these
imports cost one process's seconds at start, not every worker's. They are most of a worker's start:
`from transformers import AutoTokenizer` brings torch when it is installed, ~15 s of a core per
process on a loaded 16-core GPU host, where eight workers and a spare imported them side by side.

NOTE: nothing here may start a thread that can hold a lock while the fork server forks (torch's
import leaves one idle thread: the fork DataLoader makes after it too), nor import
prometheus_client: it picks where its values live when first imported, from the variable each worker
sets for itself (router/metrics_env.py) — so not the router's own modules either (app, metrics)."""

import fastapi  # noqa: F401
import pydantic  # noqa: F401
import starlette.applications  # noqa: F401
import uvicorn  # noqa: F401
from transformers import AutoTokenizer  # noqa: F401
