"""The README's first screen cannot rot: each command in its "Try it" block is run here as a user
would type it (the port changed, and "your vLLM replicas" are simulated engines that speak
vLLM's API), and the install line is the one CI runs on a fresh machine."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import openai
from faults import EngineProcess

from slogate.testing.ports import free_port
from slogate.testing.procs import wait_http

ROOT = Path(__file__).resolve().parent.parent


def try_it() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Try it"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "no bash block under '## Try it'"
    return [ln.split("#", 1)[0].strip() for ln in block.group(1).splitlines() if ln.split("#", 1)[0].strip()]


class Gateway:
    """A `slogate serve` command from the README, on a free port."""

    def __init__(self, argv: list[str]) -> None:
        self.port = free_port()
        assert argv[:2] == ["slogate", "serve"], argv
        self.proc = subprocess.Popen([sys.executable, "-c", "from slogate.cli import app; app()", *argv[1:], "--port", str(self.port),
                                      "--log-level", "warning"], start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        wait_http(f"{self.url}/health", timeout=60)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def test_the_first_screen_commands_work_as_written() -> None:
    cmds = try_it()
    assert len(cmds) == 4, cmds
    install, own, builtin, client = cmds
    # 1. The install line: CI runs it (with the dev extras) on a fresh machine before anything else.
    assert install == "pip install -e .", install
    assert 'pip install -q -e ".[dev]"' in (ROOT / ".ci" / "run").read_text()
    with ExitStack() as st:
        # 2. In front of "your vLLM replicas": two engines on the README's ports' stand-ins.
        argv = shlex.split(own)
        urls = [a for a in argv if a.startswith("http://")]
        assert len(urls) == 2 and argv.count("--backend") == 2, own
        engines = [st.enter_context(EngineProcess(None)) for _ in urls]
        for u, e in zip(urls, engines, strict=True):
            argv[argv.index(u)] = e.url
        gw = Gateway(argv)
        st.callback(gw.stop)
        c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in c.models.list().data] == ["sim-model"]  # discovered from the replicas
        r = c.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
        assert r.usage.completion_tokens >= 1
    # 3 and 4. The built-in simulated replicas, then the example client against them.
    gw = Gateway(shlex.split(builtin))
    try:
        argv = shlex.split(client)
        assert argv[:2] == ["python", "examples/client.py"], client
        out = subprocess.run([sys.executable, *argv[1:], "--base-url", f"{gw.url}/v1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        for line in ("latency stream: first token after", "deadline request:", "embeddings: 2 vectors", "refused as expected"):
            assert line in out.stdout, out.stdout
    finally:
        gw.stop()
