"""Send a mix of SLOs to slogate with the unmodified OpenAI SDK (only base_url changes).

    slogate serve &                      # gateway + 4 simulated engines on 127.0.0.1:8000
    python examples/client.py --base-url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse
import time

import openai


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default="sim-model")
    a = ap.parse_args()
    c = openai.OpenAI(base_url=a.base_url, api_key="unused")
    msgs = [{"role": "user", "content": "Explain step by step how a gateway schedules LLM requests."}]

    # 1. A chat stream that must start within 1 s and keep 50 ms between tokens.
    t0 = time.perf_counter()
    first = None
    for chunk in c.chat.completions.create(model=a.model, messages=msgs, max_tokens=64, stream=True,
                                           extra_body={"slo": {"ttft_ms": 1000, "tbt_ms": 50}}):
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
    print(f"latency stream: first token after {first * 1e3:.0f} ms")

    # 2. A whole answer due within 10 s (JITServe's field names work too: deadline=10).
    r = c.chat.completions.create(model=a.model, messages=msgs, max_tokens=128, extra_body={"slo": {"deadline_ms": 10_000}})
    print(f"deadline request: {r.usage.completion_tokens} tokens")

    # 3. Best effort, via the OpenAI service tier mapped in the config (or our header).
    r = c.chat.completions.create(model=a.model, messages=msgs, max_tokens=32, extra_headers={"x-slogate-class": "best_effort"})
    print(f"best effort: {r.usage.completion_tokens} tokens")

    # 4. Two calls of one agent workflow sharing a 30 s deadline.
    for stage in (0, 1):
        r = c.chat.completions.create(model=a.model, messages=msgs, max_tokens=32,
                                      extra_body={"workflow": {"id": "demo-run-1", "stage": stage, "deadline_ms": 30_000}})
        print(f"workflow stage {stage}: {r.usage.completion_tokens} tokens")

    # 5. The Responses API, streamed.
    n = sum(1 for e in c.responses.create(model=a.model, input="Say hello", max_output_tokens=16, stream=True)
            if e.type == "response.output_text.delta")
    print(f"responses stream: {n} deltas")

    # 6. Embeddings go to a replica that serves the model, like any request.
    e = c.embeddings.create(model=a.model, input=["first text", "second text"])
    print(f"embeddings: {len(e.data)} vectors of {len(e.data[0].embedding)} numbers")

    # 7. Bad SLO values are refused with a 400 in the OpenAI error shape.
    try:
        c.chat.completions.create(model=a.model, messages=msgs, extra_body={"slo": {"ttft_ms": -5}})
    except openai.BadRequestError as e:
        print(f"refused as expected: {e.body['message']}")


if __name__ == "__main__":
    main()
