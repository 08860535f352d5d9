"""Where the router's Prometheus values live: the one environment variable that says so.

A module of its own, importing nothing: router/serve.py sets the variable in a supervised worker
before anything imports prometheus_client, and router/metrics.py reads it to render; neither may
import the other (serve builds the app, which builds the metrics).
"""

# NOTE: prometheus_client reads this variable once, when it is first imported, to decide where its
# values live (a file per process in that directory, or its own memory): a worker sets it before
# anything imports prometheus_client, and --workers 1 clears it. RouterMetrics reads it to render.
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
