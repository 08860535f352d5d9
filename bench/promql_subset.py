"""The PromQL the Grafana dashboard (deploy/k8s/base/grafana-dashboard.json) uses, evaluated over
samples held in memory: what bench/dashboard_render.py draws its panels from, with no Prometheus.

    store = SeriesStore(); store.add(t, name, labels, value)   # scraped samples
    evaluate(parse(expr), store, t) -> {labels: value}          # one instant of a query

The subset, and nothing more (anything else raises UnsupportedQuery naming the expression):
  selector          name, name{label="value", ...}              (equality matchers only)
  rate              rate(selector[8s])                          (Prometheus's extrapolated rate)
  aggregations      sum(e), sum by (a, b) (e), max by (a) (e)
  quantiles         histogram_quantile(0.9, e)                  (classic `le` buckets)
  division          e / e                                       (one-to-one on all labels)
Grafana's template variables ($__rate_interval, $ttft_slo, ...) are replaced before parsing
(substitute()); labels are sorted (name, value) tuples, `__name__` among them for raw series.
"""

from __future__ import annotations

import dataclasses
import math
import re

Labels = tuple[tuple[str, str], ...]
Vector = dict[Labels, float]

LOOKBACK_S = 300.0  # an instant selector's reach back for its latest sample (Prometheus's default)
AGGREGATIONS = ("sum", "max")


class UnsupportedQuery(ValueError):
    """A query (or a part of one) outside the subset above."""


class SeriesStore:
    """Scraped samples: for each series (its labels, `__name__` included) its (time, value) points in
    the order they were added (times must not go back)."""

    def __init__(self) -> None:
        self.series: dict[str, dict[Labels, list[tuple[float, float]]]] = {}  # metric name -> labels -> points

    def add(self, t: float, name: str, labels: dict[str, str], value: float) -> None:
        key = tuple(sorted({**labels, "__name__": name}.items()))
        self.series.setdefault(name, {}).setdefault(key, []).append((t, value))

    def matching(self, name: str, matchers: Labels) -> dict[Labels, list[tuple[float, float]]]:
        found = {}
        for labels, points in self.series.get(name, {}).items():
            held = dict(labels)
            if all(held.get(label, "") == value for label, value in matchers):
                found[labels] = points
        return found


@dataclasses.dataclass(frozen=True)
class Selector:
    name: str
    matchers: Labels  # (label, value) pairs that must be equal


@dataclasses.dataclass(frozen=True)
class Rate:
    selector: Selector
    range_s: float


@dataclasses.dataclass(frozen=True)
class Aggregate:
    op: str  # one of AGGREGATIONS
    by: tuple[str, ...] | None  # None: no `by`, everything into one series
    inner: object


@dataclasses.dataclass(frozen=True)
class Quantile:
    q: float
    inner: object


@dataclasses.dataclass(frozen=True)
class Divide:
    left: object
    right: object


def substitute(expr: str, variables: dict[str, str]) -> str:
    """`expr` with each $name of `variables` replaced (longest names first: $a_b before $a)."""
    for name in sorted(variables, key=len, reverse=True):
        expr = expr.replace("$" + name, variables[name])
    return expr


TOKEN = re.compile(
    r"\s*(?:(?P<number>\d+(?:\.\d+)?(?:ms|s|m|h)?)|(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)|(?P<string>\"[^\"]*\")"
    r"|(?P<punct>[(){}\[\],/=])|(?P<other>\S))"
)
DURATION = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse(expr: str):
    """The expression's tree (Selector, Rate, Aggregate, Quantile, Divide); UnsupportedQuery outside the subset."""
    tokens = []
    for match in TOKEN.finditer(expr.strip()):
        kind = match.lastgroup
        if kind == "other":
            raise UnsupportedQuery(f"unsupported character {match.group(kind)!r} in {expr!r}")
        tokens.append((kind, match.group(kind)))
    parser = _Parser(tokens, expr)
    tree = parser.expression()
    if parser.at < len(tokens):
        parser.fail(f"unexpected {tokens[parser.at][1]!r}")
    return tree


class _Parser:
    def __init__(self, tokens: list[tuple[str, str]], expr: str):
        self.tokens, self.expr, self.at = tokens, expr, 0

    def fail(self, why: str):
        raise UnsupportedQuery(f"{why} in {self.expr!r} (bench/promql_subset.py evaluates only the dashboard's forms)")

    def peek(self) -> str:
        return self.tokens[self.at][1] if self.at < len(self.tokens) else ""

    def take(self, kind: str | None = None, text: str | None = None) -> str:
        if self.at >= len(self.tokens):
            self.fail(f"expected {text or kind}, found the end")
        got_kind, got = self.tokens[self.at]
        if (kind and got_kind != kind) or (text and got != text):
            self.fail(f"expected {text or kind}, found {got!r}")
        self.at += 1
        return got

    def expression(self):
        left = self.operand()
        if self.peek() == "/":
            self.take(text="/")
            return Divide(left, self.operand())
        return left

    def operand(self):
        name = self.take("name")
        if name in AGGREGATIONS:
            by = None
            if self.peek() == "by":
                self.take(text="by")
                by = tuple(self.name_list())
            self.take(text="(")
            inner = self.expression()
            self.take(text=")")
            if self.peek() in ("by", "without"):
                self.fail(f"a trailing `{self.peek()}` clause")
            return Aggregate(name, by, inner)
        if name == "rate":
            self.take(text="(")
            selector = self.selector(self.take("name"), in_rate=True)
            self.take(text="[")
            range_s = self.duration(self.take("number"))
            self.take(text="]")
            self.take(text=")")
            return Rate(selector, range_s)
        if name == "histogram_quantile":
            self.take(text="(")
            q = float(self.take("number"))
            self.take(text=",")
            inner = self.expression()
            self.take(text=")")
            return Quantile(q, inner)
        if self.peek() == "(":
            self.fail(f"the function or aggregation {name!r}")
        return self.selector(name)

    def selector(self, name: str, in_rate: bool = False) -> Selector:
        matchers = []
        if self.peek() == "{":
            self.take(text="{")
            while self.peek() != "}":
                label = self.take("name")
                self.take(text="=")  # (`!=`, `=~`, `!~` fail here: `!` and `~` are not tokens)
                matchers.append((label, self.take("string")[1:-1]))
                if self.peek() == ",":
                    self.take(text=",")
            self.take(text="}")
        if self.peek() == "[" and not in_rate:
            self.fail("a range selector outside rate()")
        return Selector(name, tuple(matchers))

    def name_list(self) -> list[str]:
        self.take(text="(")
        names = [self.take("name")]
        while self.peek() == ",":
            self.take(text=",")
            names.append(self.take("name"))
        self.take(text=")")
        return names

    def duration(self, text: str) -> float:
        unit = re.sub(r"[\d.]", "", text)
        if unit not in DURATION:
            self.fail(f"a duration without a unit ({text!r})")
        return float(text[: len(text) - len(unit)]) * DURATION[unit]


def evaluate(node, store: SeriesStore, t: float) -> Vector:
    """The instant vector of `node` at time `t` (seconds, the store's clock)."""
    if isinstance(node, Selector):
        vector = {}
        for labels, points in store.matching(node.name, node.matchers).items():
            latest = [v for at, v in points if t - LOOKBACK_S < at <= t]
            if latest:
                vector[labels] = latest[-1]
        return vector
    if isinstance(node, Rate):
        vector = {}
        for labels, points in store.matching(node.selector.name, node.selector.matchers).items():
            window = [(at, v) for at, v in points if t - node.range_s < at <= t]
            rate = extrapolated_rate(window, t - node.range_s, t)
            if rate is not None:
                vector[_without(labels, "__name__")] = rate
        return vector
    if isinstance(node, Aggregate):
        groups: Vector = {}
        for labels, value in evaluate(node.inner, store, t).items():
            key = tuple((k, v) for k, v in labels if k in node.by) if node.by is not None else ()
            if key not in groups:
                groups[key] = value
            elif node.op == "sum":
                groups[key] += value
            else:
                groups[key] = max(groups[key], value)
        return groups
    if isinstance(node, Quantile):
        buckets: dict[Labels, list[tuple[float, float]]] = {}  # labels but `le` -> (upper bound, count)
        for labels, value in evaluate(node.inner, store, t).items():
            held = dict(labels)
            if "le" not in held:
                continue  # (Prometheus skips a series with no `le` too)
            buckets.setdefault(_without(labels, "le", "__name__"), []).append((float(held["le"]), value))
        return {labels: bucket_quantile(node.q, points) for labels, points in buckets.items()}
    if isinstance(node, Divide):
        left, right = evaluate(node.left, store, t), evaluate(node.right, store, t)
        vector = {}
        for labels, value in left.items():
            key = _without(labels, "__name__")
            for other, divisor in right.items():
                if _without(other, "__name__") == key:
                    vector[key] = _divide(value, divisor)
        return vector
    raise UnsupportedQuery(f"no evaluation for {node!r}")


def extrapolated_rate(points: list[tuple[float, float]], start: float, end: float) -> float | None:
    """Per-second increase of a counter over (start, end] from its samples there, as Prometheus's rate()
    computes it (promql/functions.go extrapolatedRate): resets add the value before them; the increase
    is stretched to the window's edges, each by at most half the mean sample gap when the series
    starts or stops more than 1.1 gaps from that edge, and never below zero. None with < 2 samples."""
    if len(points) < 2:
        return None
    increase = points[-1][1] - points[0][1]
    previous = points[0][1]
    for _, value in points[1:]:
        if value < previous:
            increase += previous  # NOTE: a counter reset (a restarted process): it started again from 0
        previous = value
    sampled = points[-1][0] - points[0][0]
    mean_gap = sampled / (len(points) - 1)
    to_start, to_end = points[0][0] - start, end - points[-1][0]
    if increase > 0 and points[0][1] >= 0:
        to_start = min(to_start, sampled * points[0][1] / increase)  # a counter is never below zero
    stretched = sampled
    stretched += to_start if to_start < 1.1 * mean_gap else mean_gap / 2
    stretched += to_end if to_end < 1.1 * mean_gap else mean_gap / 2
    return increase * stretched / sampled / (end - start)


def bucket_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """The q-quantile of cumulative buckets (upper bound, count), as Prometheus's histogram_quantile:
    linear within the bucket the rank falls in (from 0 for the first bucket if its bound is > 0); the
    +Inf bucket's rank answers the highest finite bound; NaN without a +Inf bucket or observations."""
    if math.isnan(q):
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    merged: dict[float, float] = {}
    for bound, count in buckets:
        merged[bound] = merged.get(bound, 0.0) + count
    ordered = sorted(merged.items())
    if len(ordered) < 2 or ordered[-1][0] != math.inf:
        return math.nan
    monotonic, highest = [], 0.0
    for bound, count in ordered:
        highest = max(highest, count)  # NOTE: rates of buckets scraped apart can dip; Prometheus evens them
        monotonic.append((bound, highest))
    observations = monotonic[-1][1]
    if observations == 0:
        return math.nan
    rank = q * observations
    b = 0
    while b < len(monotonic) - 1 and monotonic[b][1] < rank:
        b += 1
    if b == len(monotonic) - 1:
        return monotonic[-2][0]
    if b == 0 and monotonic[0][0] <= 0:
        return monotonic[0][0]
    start, below = (monotonic[b - 1][0], monotonic[b - 1][1]) if b > 0 else (0.0, 0.0)
    end, count = monotonic[b][0], monotonic[b][1] - below
    if count == 0:
        return math.nan  # (q = 0 over an empty first bucket: Go's 0/0)
    return start + (end - start) * (rank - below) / count


def _without(labels: Labels, *names: str) -> Labels:
    return tuple((k, v) for k, v in labels if k not in names)


def _divide(a: float, b: float) -> float:
    if b == 0:
        return math.nan if a == 0 or math.isnan(a) else math.copysign(math.inf, a)
    return a / b
