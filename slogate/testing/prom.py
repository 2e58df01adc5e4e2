"""Reading a Prometheus exposition (the gateway's, an engine's) with prometheus_client's parser."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

_SUFFIXES = ("_total", "_count", "_sum", "_bucket", "_created")


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample called `name` (e.g. `slogate_requests_total`). Only the
    lines of its family are parsed: a test polling a gateway in its own process must not take
    the GIL from it for the whole exposition."""
    base = next((name[: -len(s)] for s in _SUFFIXES if name.endswith(s)), name)
    mine = "\n".join(ln for ln in text.splitlines() if ln.startswith((base, f"# HELP {base}", f"# TYPE {base}"))) + "\n"
    return [(s.labels, s.value) for fam in text_string_to_metric_families(mine) for s in fam.samples if s.name == name]


def scrape(url: str, timeout: float = 5.0) -> str:
    """The exposition at `url`/metrics."""
    return httpx.get(f"{url}/metrics", timeout=timeout).text


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of `name` over the samples whose labels include `labels` (0 when there is none)."""
    return sum(v for lab, v in samples(scrape(url), name) if all(lab.get(k) == x for k, x in labels.items()))


def gauge(url: str, name: str, **labels: str) -> float | None:
    """The first sample of `name` whose labels include `labels`, or None."""
    return next((v for lab, v in samples(scrape(url), name) if all(lab.get(k) == x for k, x in labels.items())), None)
