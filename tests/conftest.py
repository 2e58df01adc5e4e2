from __future__ import annotations

import csv
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture
def data_dir() -> Path:
    if not (DATA / "trace_azure2023_conv.csv").exists():
        pytest.skip(f"shared data not found at {DATA}")
    return DATA


@pytest.fixture
def synthetic_trace(tmp_path: Path) -> Path:
    """A bursty trace: 600 requests in 20 s, mixed lengths, deterministic."""
    p = tmp_path / "trace.csv"
    with p.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arrival_s", "input_tokens", "output_tokens"])
        for i in range(600):
            w.writerow([round(i * 20 / 600, 4), 200 + (i * 137) % 1800, 20 + (i * 53) % 400])
    return p
