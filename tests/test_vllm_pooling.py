"""Embeddings from a real vLLM pooling model through the gateway (its own module: the chat
engine of test_vllm.py is stopped before this one starts, one engine at a time on a small box)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from servers import ServerThread
from vllm_engine import start_vllm

from slogate.gateway.app import create_app
from slogate.gateway.config import GatewayConfig
from slogate.testing.prom import samples, scrape


@pytest.fixture(scope="module")
def vllm_embed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # The tiny Llama served as an embedding model: vLLM converts it (last-token pooling, normalised).
    yield from start_vllm(tmp_path_factory, "--runner", "pooling", "--convert", "embed", "--max-num-seqs", "4")


def test_embeddings_through_the_gateway_from_a_real_vllm_pooling_model(vllm_embed: str) -> None:
    cfg = GatewayConfig.model_validate({"backends": [{"url": vllm_embed, "budget": 4}], "health_interval_s": 0.5})
    with ServerThread(create_app(cfg)) as gw:
        c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
        r = c.embeddings.create(model="tiny", input=["hello world", "a different text", "hello world"])
        vecs = [d.embedding for d in r.data]
        assert len(vecs) == 3 and len(vecs[0]) > 8 and r.usage.prompt_tokens > 0
        assert abs(sum(x * x for x in vecs[0]) - 1) < 1e-3  # normalised by vLLM's embed pooler
        assert max(abs(a - b) for a, b in zip(vecs[0], vecs[2], strict=True)) < 1e-4
        assert max(abs(a - b) for a, b in zip(vecs[0], vecs[1], strict=True)) > 1e-4
        f = c.embeddings.create(model="tiny", input="hello world", encoding_format="float")
        assert max(abs(a - b) for a, b in zip(f.data[0].embedding, vecs[0], strict=True)) < 1e-4
        tok = httpx.post(f"{gw.url}/tokenize", json={"model": "tiny", "prompt": "hello world"}, timeout=30)
        assert tok.status_code == 200 and tok.json()["count"] == len(tok.json()["tokens"]) > 0
        done = {(lab["slo_class"], lab["outcome"]): v for lab, v in samples(scrape(gw.url), "slogate_requests_total")}
        assert done == {("deadline", "completed"): 3.0}, done  # two embeddings, one tokenize
