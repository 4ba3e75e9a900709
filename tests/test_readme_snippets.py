"""README's Python client snippet(s) and the `mfs serve` line they talk to, run as written against a real `mfs serve`
of the shipped tiny family. The one change made to either is the port: a free one instead of 8000, substituted
explicitly below (the same port in the serve line's `--port` and the snippet's base_url)."""
from __future__ import annotations

import contextlib
import io
import re
import shlex
import sys
import time
from pathlib import Path

import httpx

from tests.fakes_serving import free_port, start_process, stop_process
from tests.test_examples import COMMAND

README = Path(__file__).resolve().parents[1] / "README.md"
README_PORT = "8000"
README_BASE_URL = f"http://127.0.0.1:{README_PORT}"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def client_snippets() -> list[str]:
    found = [block for block in blocks("python") if "OpenAI(" in block]
    assert found, "README has no Python client snippet"
    return found


def serve_line() -> list[str]:
    """README's `mfs serve` line that the client snippet talks to: the one with --api-key (comment cut)."""
    lines = [COMMAND.match(line.strip()).group(1) for block in blocks("bash") for line in block.splitlines()
             if line.startswith("mfs serve ") and "--api-key" in line]
    assert len(lines) == 1, f"README should have one `mfs serve ... --api-key` line, has {lines}"
    return shlex.split(lines[0])


def api_key_of(words: list[str]) -> str:
    return words[words.index("--api-key") + 1]


def on_port(words: list[str], port: int) -> list[str]:
    """The serve line with its --port 8000 replaced by `port` (the only change made to it)."""
    i = words.index("--port")
    assert words[i + 1] == README_PORT
    return [*words[:i + 1], str(port), *words[i + 2:]]


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_client_snippets_use_the_served_lines_key_and_port():
    words = serve_line()
    assert words[words.index("--port") + 1] == README_PORT
    for snippet in client_snippets():
        assert f'base_url="{README_BASE_URL}/v1"' in snippet
        assert f'api_key="{api_key_of(words)}"' in snippet


def test_the_client_snippets_run_against_the_readme_serve_line(tmp_path):
    port = free_port()
    words = on_port(serve_line(), port)
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    # `mfs` is the console script of orchestrator.serve.cli:main; run in the repository root, as the README is
    proc = start_process([sys.executable, "-m", "orchestrator.serve.cli", *words[1:]], log_path)
    try:
        deadline = time.monotonic() + 300
        while not healthy(url) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert healthy(url), log_path.read_text()
        # the key is really required, so a snippet that answers below really sends it
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        assert httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 401
        for snippet in client_snippets():
            code = snippet.replace(README_BASE_URL, url)
            assert code.count(url) == 1
            out = io.StringIO()
            namespace: dict = {"__name__": "readme_snippet"}
            with contextlib.redirect_stdout(out):
                exec(compile(code, f"{README.name} (client snippet)", "exec"), namespace)
            reply = namespace["reply"]
            assert reply.model in ("tiny-s", "tiny-m", "tiny-l") and reply.usage.completion_tokens > 0
            assert out.getvalue().strip(), "the snippet printed nothing"
    finally:
        stop_process(proc)
