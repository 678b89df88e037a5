"""The docs-example machinery itself: what it extracts, what it skips, and that a broken
example fails (against a small local HTTP server, no model needed)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from doc_examples import (
    DocFormatError,
    all_blocks,
    read_blocks,
    rewrite_port,
    split_commands,
)
from docs_server import LiveServer
from test_doc_examples import run_curl

PAGE = """Intro

<!-- docs-test: skip (needs a GPU) -->
```bash
nvidia-smi
```

1. In a list:

   ```bash
   curl http://127.0.0.1:8080/v1/chat/completions \\
     -H "Content-Type: application/json" \\
     -d '{"messages": [{"role": "user",
                        "content": "two lines"}]}'
   strata info  # a comment
   ```
"""


def test_blocks_markers_and_commands():
    skipped, listed = read_blocks("page.md", PAGE)
    assert (skipped.line, skipped.skip_reason) == (4, "needs a GPU")
    assert listed.skip_reason is None and listed.lang == "bash"
    curl, info = split_commands(listed)
    assert curl.argv[0] == "curl" and curl.argv[-2] == "-d"
    assert json.loads(curl.argv[-1])["messages"][0]["content"] == "two lines"
    assert info.argv == ("strata", "info")


def test_a_misspelt_marker_is_an_error():
    with pytest.raises(DocFormatError, match="is not '<!-- docs-test: skip"):
        read_blocks("page.md", "<!-- docs-test: skipp -->\n```bash\nstrata info\n```\n")


def test_an_unclosed_block_is_an_error():
    with pytest.raises(DocFormatError, match="never closed"):
        read_blocks("page.md", "```bash\nstrata info\n")


def test_port_rewrite():
    assert rewrite_port("http://localhost:8080/v1 and 127.0.0.1:8080", 5) == \
        "http://127.0.0.1:5/v1 and 127.0.0.1:5"
    assert rewrite_port("http://127.0.0.1:80801", 5) == "http://127.0.0.1:80801"


def test_the_user_docs_have_runnable_examples():
    blocks = all_blocks()
    runnable = [b for b in blocks if b.skip_reason is None and b.lang in ("bash", "python")]
    assert {b.page for b in runnable} >= {"getting-started.md", "api.md", "sharing-the-gpu.md"}
    assert len(runnable) >= 20
    skipped = [b for b in blocks if b.skip_reason is not None]
    assert len(skipped) <= len(runnable) // 2, "skip markers are for the few that cannot run"


class _Handler(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        status = {"/ok": 200, "/sleep": 400}.get(self.path, 404)
        body = ({"ok": True} if status == 200 else
                {"error": {"message": "no", "type": "invalid_request_error", "code": "x"}})
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def little_server(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    (tmp_path / "log").write_text("")
    yield LiveServer(server.server_address[1], {}, tmp_path / "log")
    server.shutdown()


def _curl(text: str):
    (block,) = read_blocks("page.md", f"```bash\n{text}\n```\n")
    return split_commands(block)[0]


def test_curl_examples_pass_and_fail_as_they_should(little_server, tmp_path):
    run_curl(_curl("curl http://127.0.0.1:8080/ok"), little_server, tmp_path)
    # A lifecycle level that does not apply answers a 4xx JSON error: accepted.
    run_curl(_curl("curl -X POST http://127.0.0.1:8080/sleep"), little_server, tmp_path)
    with pytest.raises(AssertionError, match="HTTP 404"):
        run_curl(_curl("curl http://127.0.0.1:8080/v1/nothing"), little_server, tmp_path)
    with pytest.raises(AssertionError, match=r"must call http://127.0.0.1:8080"):
        run_curl(_curl("curl http://example.org/"), little_server, tmp_path)
