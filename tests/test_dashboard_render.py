"""The PromQL subset bench/dashboard_render.py draws the dashboard with (bench/promql_subset.py): every
query of deploy/k8s/base/grafana-dashboard.json evaluates, rate / histogram_quantile / sum by / max by /
division agree with values worked by hand, anything else is refused by name. No stack, no Grafana."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from pdserve.bench.dashboard_render import (
    DASHBOARD,
    add_exposition,
    dashboard_variables,
    legend_of,
    panel_curves,
    panel_queries,
)
from pdserve.bench.promql_subset import (
    Selector,
    SeriesStore,
    UnsupportedQuery,
    bucket_quantile,
    evaluate,
    extrapolated_rate,
    parse,
)

INF = math.inf


def selectors_of(node) -> list[Selector]:
    if isinstance(node, Selector):
        return [node]
    found = []
    for field in dataclasses.fields(node):
        value = getattr(node, field.name)
        if dataclasses.is_dataclass(value):
            found += selectors_of(value)
    return found


def test_every_dashboard_query_evaluates_to_a_series():
    """Each target of each panel parses (a query form the subset lacks fails here) and, over synthetic
    series of every metric it reads, yields at least one finite value."""
    dashboard = json.loads(DASHBOARD.read_text())
    variables = dashboard_variables(dashboard, 8.0)
    assert variables["__rate_interval"] == "8s" and variables["ttft_slo"] == "1.0" and variables["tpot_slo"] == "0.025"
    panels = panel_queries(dashboard, variables)
    targets = [target for _, panel_targets in panels for target in panel_targets]
    assert len(targets) == sum(len(p.get("targets", ())) for p in dashboard["panels"]) >= 40
    store = SeriesStore()
    labels = {"role": "decode", "status": "200", "reason": "r", "worker": "w", "instance": "h:1", "job": "j"}
    names = {s.name for _, query in targets for s in selectors_of(query)}
    bounds = ["0.025", "0.1", "1.0", "+Inf"]
    for t in range(1, 20, 2):
        for name in names:
            if name.endswith("_bucket"):
                for i, le in enumerate(bounds):
                    store.add(t, name, {**labels, "le": le}, 100.0 + t * (i + 1))
            else:
                store.add(t, name, labels, 100.0 + t)
    for legend, query in targets:
        values = evaluate(query, store, 19.0).values()
        assert any(math.isfinite(v) for v in values), (legend, query)


def test_rate_extrapolates_as_prometheus():
    """Prometheus's extrapolatedRate, worked by hand over (0, 8]."""
    # from zero, samples 1 s inside each edge: the start stops at zero (0 s back), the end stretches 1 s
    assert extrapolated_rate([(1, 0), (3, 10), (5, 20), (7, 30)], 0, 8) == pytest.approx(30 * 7 / 6 / 8)
    # far from zero: both edges stretch their whole second, the slope exactly
    assert extrapolated_rate([(1, 100), (3, 110), (5, 120), (7, 130)], 0, 8) == pytest.approx(5.0)
    # a reset at t=5 adds the 110 before it: increase 15 - 100 + 110 = 25
    assert extrapolated_rate([(1, 100), (3, 110), (5, 5), (7, 15)], 0, 8) == pytest.approx(25 * 8 / 6 / 8)
    # edges more than 1.1 mean gaps away stretch half a gap each: 10 over 2 + 1 + 1 s, per 10 s
    assert extrapolated_rate([(4, 100), (6, 110)], 0, 10) == pytest.approx(10 * 4 / 2 / 10)
    assert extrapolated_rate([(4, 100)], 0, 10) is None


def test_bucket_quantile_interpolates_as_prometheus():
    buckets = [(0.5, 30), (0.1, 10), (1.0, 40), (INF, 40)]  # (unordered: sorted by bound)
    assert bucket_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * 10 / 20)
    assert bucket_quantile(0.9, buckets) == pytest.approx(0.5 + 0.5 * 6 / 10)
    assert bucket_quantile(0.1, buckets) == pytest.approx(0.1 * 4 / 10)  # the first bucket starts at 0
    assert bucket_quantile(0.99, [(0.1, 10), (INF, 20)]) == 0.1  # the rank in +Inf: the highest finite bound
    assert bucket_quantile(0.5, [(0.1, 0), (0.5, 4), (0.25, 3), (INF, 4)]) == pytest.approx(0.1 + 0.15 * 2 / 3)
    assert bucket_quantile(0.5, [(0.1, 5), (0.5, 4), (INF, 6)]) == pytest.approx(0.1 * 3 / 5)  # evened: 5, 5, 6
    assert math.isnan(bucket_quantile(0.5, [(0.1, 1), (1.0, 2)]))  # no +Inf bucket
    assert math.isnan(bucket_quantile(0.5, [(0.1, 0), (INF, 0)]))  # no observations
    assert bucket_quantile(-1, buckets) == -INF and bucket_quantile(2, buckets) == INF


def linear_store() -> SeriesStore:
    """Counters at t = 1, 3, 5, 7 far from zero (so rate over (0, 8] is their slope exactly)."""
    store = SeriesStore()
    slopes = {  # (instance, role) -> {le: slope}
        ("a:1", "prefill"): {"0.1": 1, "0.5": 3, "+Inf": 4},
        ("b:1", "prefill"): {"0.1": 1, "0.5": 1, "+Inf": 4},
        ("c:1", "decode"): {"0.1": 0, "0.5": 2, "+Inf": 2},
    }
    for t in (1, 3, 5, 7):
        for (instance, role), by_le in slopes.items():
            for le, slope in by_le.items():
                store.add(t, "m_bucket", {"instance": instance, "role": role, "le": le}, 1000 + slope * t)
            store.add(t, "m_count", {"instance": instance, "role": role}, 1000 + by_le["+Inf"] * t)
            store.add(t, "gauge", {"instance": instance, "role": role}, {"a:1": 3, "b:1": 5, "c:1": 4}[instance])
            store.add(t, "total", {"instance": instance, "role": role}, 10)
        store.add(t, "req_total", {"status": "200", "instance": "r:1"}, 1000 + 6 * t)
        store.add(t, "req_total", {"status": "400", "instance": "r:1"}, 1000 + 1 * t)
        store.add(t, "req_total", {"status": "200", "instance": "r:2"}, 1000 + 2 * t)
    return store


def at_8(expr: str) -> dict:
    """The expression at t = 8 over linear_store(), as {labels as a dict's items: value}."""
    return {labels: value for labels, value in evaluate(parse(expr), linear_store(), 8.0).items()}


def test_aggregations_quantiles_and_ratios_over_series():
    assert at_8("sum by (status) (rate(req_total[8s]))") == {
        (("status", "200"),): pytest.approx(8.0),
        (("status", "400"),): pytest.approx(1.0),
    }
    assert at_8("sum(rate(req_total[8s]))") == {(): pytest.approx(9.0)}
    # prefill's buckets summed: 0.1 -> 2, 0.5 -> 4, +Inf -> 8; rank 3 of 8 is in (0.1, 0.5]
    quantiles = at_8("histogram_quantile(0.375, sum by (le, role) (rate(m_bucket[8s])))")
    assert quantiles == {
        (("role", "prefill"),): pytest.approx(0.3),
        (("role", "decode"),): pytest.approx(0.1 + 0.4 * 0.75 / 2),
    }
    assert at_8("histogram_quantile(0.375, sum by (le) (rate(m_bucket[8s])))") == {
        (): pytest.approx(0.1 + 0.4 * 1.75 / 4)
    }
    # goodput's form: the share within a bound
    assert at_8('sum(rate(m_bucket{le="0.5"}[8s])) / sum(rate(m_count[8s]))') == {(): pytest.approx(6 / 10)}
    assert at_8("max by (role) (gauge)") == {(("role", "prefill"),): 5, (("role", "decode"),): 4}
    ratios = at_8("gauge / total")
    assert ratios[(("instance", "a:1"), ("role", "prefill"))] == pytest.approx(0.3) and len(ratios) == 3
    assert at_8('gauge{instance="b:1"}') == {(("__name__", "gauge"), ("instance", "b:1"), ("role", "prefill")): 5}
    assert at_8('gauge{role="nobody"}') == {}


@pytest.mark.parametrize(
    "expr",
    [
        "avg(rate(m[5m]))",
        "irate(m[5m])",
        'm{a!="b"}',
        'm{a=~"b.*"}',
        "m + m",
        "sum(m) by (a)",
        "sum without (a) (m)",
        "rate(m[5m] offset 1m)",
        "m[5m]",
        "rate(m[5])",
        "histogram_quantile(0.9, rate(m_bucket[5m])) > 1",
    ],
)
def test_forms_outside_the_subset_are_refused_by_name(expr):
    with pytest.raises(UnsupportedQuery) as refused:
        parse(expr)
    assert repr(expr) in str(refused.value)


def test_scraped_histogram_text_answers_the_dashboard_forms():
    """prometheus_client's own exposition, parsed as the scraper does: `le` reads "1.0" (what the SLO
    variables hold), and the instance label fills the legend."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    registry = CollectorRegistry()
    ttft = Histogram("ttft_seconds", "ttft", buckets=(0.5, 1.0, 2.5), registry=registry)
    store = SeriesStore()
    for t in (1, 3, 5, 7):
        for value in (0.2, 0.7, 2.0, 3.0):  # a quarter in each bucket, per scrape
            ttft.observe(value)
        add_exposition(store, generate_latest(registry).decode(), float(t), "router", "127.0.0.1:9")
    share = evaluate(
        parse('sum(rate(ttft_seconds_bucket{le="1.0"}[8s])) / sum(rate(ttft_seconds_count[8s]))'), store, 8
    )
    assert share == {(): pytest.approx(0.5)}
    query = parse("histogram_quantile(0.5, sum by (le, instance) (rate(ttft_seconds_bucket[8s])))")
    (labels, median), *_ = evaluate(query, store, 8).items()
    assert median == pytest.approx(1.0) and legend_of("p50 {{instance}} {{role}}", labels) == "p50 127.0.0.1:9"
    curves = panel_curves([("p50 {{instance}}", query)], store, [6.0, 7.0, 8.0], t0=1.0)
    assert [(c.legend, c.times) for c in curves] == [("p50 127.0.0.1:9", [5.0, 6.0, 7.0])]
    assert curves[0].values == pytest.approx([1.0, 1.0, 1.0])  # every bucket's rate stretched alike
