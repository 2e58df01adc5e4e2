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


# Synthetic prompts whose answer length depends on what they ask (and on who answers): a
# predictor that reads the prompt must beat a global quantile by far.
_TASKS = [("Answer in one word: what is the capital of {x}?", 3, 0.3), ("Write a detailed essay about {x}.", 420, 0.25),
          ("List ten facts about {x}.", 160, 0.2), ("Translate 'hello {x}' to French.", 8, 0.3),
          ("Explain step by step how {x} works.", 260, 0.3), ("Write a python function that sorts {x}.", 120, 0.3)]
_TOPICS = ["france", "rivers", "volcanoes", "the moon", "bees", "trains", "glass", "jazz", "tea", "chess", "clouds", "salt"]


def synthetic_prompt_rows(n: int, seed: int = 0) -> list[dict]:
    import math
    import random

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        tmpl, mu, sigma = _TASKS[i % len(_TASKS)]
        topic = f"{rng.choice(_TOPICS)} {i // 7}"  # each prompt text repeats for a few responders
        model = rng.choice(["terse-llm", "chatty-llm"])
        scale = 0.6 if model == "terse-llm" else 1.5
        length = max(1, round(mu * scale * math.exp(rng.gauss(0, sigma))))
        prompt = tmpl.format(x=topic)
        rows.append({"prompt": prompt, "response_len_tokens_cl100k": length, "prompt_len_tokens_cl100k": len(prompt) // 4,
                     "source": "synthetic", "model": model, "id": str(i)})
    return rows


@pytest.fixture
def synthetic_prompts(tmp_path: Path) -> Path:
    import json

    p = tmp_path / "prompts_synthetic.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in synthetic_prompt_rows(3000)) + "\n")
    return p


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real redis-server of our own on a free port (installed by .ci/run when missing)."""
    from slogate.testing.ports import free_port
    from slogate.testing.procs import start_redis

    port = free_port()
    try:
        proc = start_redis(port, tmp_path_factory.mktemp("redis"))
    except FileNotFoundError:
        pytest.skip("redis-server is not installed")
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)
