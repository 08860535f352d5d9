"""The Grafana dashboard (deploy/k8s/base/grafana-dashboard.json) drawn from a live local stack, with
no Grafana or Prometheus: `pdserve up` on the CPU with the tiny random model, a mixed load from the
openai client, every process's /metrics scraped every few seconds into memory, each panel's queries
evaluated over those samples (bench/promql_subset.py) and drawn with matplotlib where the dashboard
places the panel.

    python -m pdserve.bench.dashboard_render --seconds 75 --out docs/img/dashboard-cpu-tiny.png
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass

from pdserve.bench.dashboard_load import drive_load
from pdserve.bench.promql_subset import SeriesStore, evaluate, parse, substitute
from pdserve.common.ports import free_port

DASHBOARD = pathlib.Path(__file__).resolve().parent.parent / "deploy" / "k8s" / "base" / "grafana-dashboard.json"
STACK_START_TIMEOUT_S = 600  # `pdserve up` on a busy 2-core machine: a few interpreters importing torch at once


@dataclass
class Curve:
    """One series of one panel: its legend and its points (seconds since the load began, value)."""

    legend: str
    times: list[float]
    values: list[float]


def dashboard_variables(dashboard: dict, rate_interval_s: float) -> dict[str, str]:
    """The values Grafana would put in the queries: each custom variable's default (`current`), and
    $__rate_interval."""
    variables = {"__rate_interval": f"{rate_interval_s:g}s"}
    for variable in dashboard.get("templating", {}).get("list", ()):
        if variable.get("type") == "custom":
            variables[variable["name"]] = variable["current"]["value"]
    return variables


def panel_queries(dashboard: dict, variables: dict[str, str]) -> list[tuple[dict, list[tuple[str, object]]]]:
    """Each graph panel with its targets as (legendFormat, parsed query), variables substituted.
    UnsupportedQuery for a query outside bench/promql_subset.py's subset."""
    panels = []
    for panel in dashboard["panels"]:
        if panel.get("type") == "row":
            continue
        targets = []
        for target in panel.get("targets", ()):
            legend = substitute(target.get("legendFormat", ""), variables)
            targets.append((legend, parse(substitute(target["expr"], variables))))
        panels.append((panel, targets))
    return panels


def legend_of(legend_format: str, labels: tuple[tuple[str, str], ...]) -> str:
    """Grafana's legend: each {{label}} replaced by the series' value (empty when it has none)."""
    held = dict(labels)
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: held.get(m.group(1), ""), legend_format).strip()


def panel_curves(targets: list[tuple[str, object]], store: SeriesStore, times: list[float], t0: float) -> list[Curve]:
    """Every series the panel's targets yield over `times` (the store's clock), times shifted by `t0`."""
    curves: list[Curve] = []
    for legend_format, query in targets:
        by_labels: dict[tuple, Curve] = {}
        for t in times:
            for labels, value in sorted(evaluate(query, store, t).items()):
                if labels not in by_labels:
                    by_labels[labels] = Curve(legend_of(legend_format, labels) or str(dict(labels)), [], [])
                by_labels[labels].times.append(t - t0)
                by_labels[labels].values.append(value)
        curves.extend(by_labels.values())
    return curves


# --- the live stack and its scraping --------------------------------------------------------------


class LocalUp:
    """`pdserve up` on the CPU (tiny random llama, one prefill and one decode server, one router
    process) in a child process; `targets` are the /metrics URLs it prints, by job name."""

    def __init__(self, port: int):
        self.log = tempfile.NamedTemporaryFile(mode="w+", prefix="pdserve-dashboard-", suffix=".log")
        # NOTE: output to a file, not a pipe nobody reads while the load runs: a full pipe would block
        # the stack's next write and look like a hang.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.common.cli", "up", "--tiny-model", "--device", "cpu"]
            + ["--num-prefill", "1", "--num-decode", "1", "--router-workers", "1", "--port", str(port)]
            + ["--log-level", "warning"],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.base_url = f"http://127.0.0.1:{port}"
        self.targets = self._wait_for_metrics_line()

    def _wait_for_metrics_line(self) -> dict[str, str]:
        """{"router": url, "prefill_0": url, ...} from up's line `metrics: router URL, prefill 0 URL, ...`."""
        deadline = time.monotonic() + STACK_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pdserve up exited with code {self.proc.returncode}:\n{self.output()}")
            for line in self.output().splitlines():
                if line.startswith("metrics: "):
                    targets = {}
                    for entry in line[len("metrics: ") :].split(", "):
                        who, url = entry.rsplit(" ", 1)
                        targets[who.replace(" ", "_")] = url
                    return targets
            time.sleep(0.5)
        raise TimeoutError(f"pdserve up not ready after {STACK_START_TIMEOUT_S} s:\n{self.output()}")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # up stops its servers (they drain) and the router
            self.proc.wait(120)
        self.log.close()


def scrape_once(store: SeriesStore, targets: dict[str, str], t: float) -> None:
    """One round: every target's /metrics into `store` at time `t`."""
    for job, url in targets.items():
        with urllib.request.urlopen(url, timeout=5) as answer:
            text = answer.read().decode()
        add_exposition(store, text, t, job, instance=url.split("//", 1)[1].split("/", 1)[0])


def add_exposition(store: SeriesStore, text: str, t: float, job: str, instance: str) -> None:
    """A Prometheus text exposition's samples into `store` at `t`, with the labels Prometheus adds to
    what it scrapes (`job`, and `instance`: the target's host:port), as the {{instance}} legends expect."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue  # (the client library's creation stamps: no panel reads them)
            store.add(t, sample.name, {**sample.labels, "job": job, "instance": instance}, sample.value)


class Scraper:
    """A thread scraping every `interval_s` until stopped; `times` are the rounds' times (monotonic)."""

    def __init__(self, store: SeriesStore, targets: dict[str, str], interval_s: float):
        self.store, self.targets, self.interval_s = store, targets, interval_s
        self.times: list[float] = []
        self.errors: list[str] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="scraper", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self.stopped.is_set():
            t = time.monotonic()
            try:
                scrape_once(self.store, self.targets, t)
                self.times.append(t)
            except OSError as e:
                self.errors.append(f"{t:.1f}: {e}")
            next_at += self.interval_s
            self.stopped.wait(max(0.0, next_at - time.monotonic()))

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], prog="python -m pdserve.bench.dashboard_render"
    )
    parser.add_argument("--seconds", type=float, default=75, help="How long the load runs.")
    parser.add_argument("--clients", type=int, default=3, help="Concurrent clients of the load.")
    parser.add_argument("--scrape-interval", type=float, default=2.0, help="Seconds between scrapes.")
    parser.add_argument("--out", default="docs/img/dashboard-cpu-tiny.png", help="The PNG to write.")
    args = parser.parse_args(argv)

    from pdserve.bench.dashboard_draw import draw_dashboard

    dashboard = json.loads(DASHBOARD.read_text())
    # Grafana's $__rate_interval: max($__interval + scrape interval, 4 x scrape interval); with a short
    # range $__interval is the scrape interval, so 4 x it.
    rate_interval_s = 4 * args.scrape_interval
    panels = panel_queries(dashboard, dashboard_variables(dashboard, rate_interval_s))  # fails before the stack
    store = SeriesStore()
    stack = LocalUp(free_port())
    try:
        print(f"stack up: {stack.base_url}; scraping {', '.join(stack.targets.values())}", flush=True)
        scraper = Scraper(store, stack.targets, args.scrape_interval)
        time.sleep(2 * args.scrape_interval)  # a baseline before the load: the first rates start from it
        load_start = time.monotonic()
        summary = drive_load(stack.base_url, args.seconds, args.clients)
        time.sleep(2 * args.scrape_interval)
        scraper.stop()
    finally:
        stack.stop()
    print(f"load: {summary}; {len(scraper.times)} scrapes, {len(scraper.errors)} failed", flush=True)
    if not scraper.times:
        raise RuntimeError("no scrape succeeded: " + "; ".join(scraper.errors[-3:]))
    times = [t for t in scraper.times if t >= scraper.times[0] + rate_interval_s]
    curves = [(panel, panel_curves(targets, store, times, load_start)) for panel, targets in panels]
    rows = [panel for panel in dashboard["panels"] if panel.get("type") == "row"]
    subtitle = (
        f"{dashboard['title']}: the panels' queries evaluated by bench/dashboard_render.py over /metrics scraped every "
        f"{args.scrape_interval:g} s from `pdserve up --tiny-model --device cpu` under {args.clients} clients "
        f"({summary}); $__rate_interval = {rate_interval_s:g}s. Not Grafana."
    )
    draw_dashboard(rows, curves, subtitle, args.out)
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
