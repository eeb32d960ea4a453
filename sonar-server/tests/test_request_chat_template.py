"""A chat template sent with a request runs only where the operator allowed it
(``--trust-request-chat-template``), and then inside the template sandbox."""

from __future__ import annotations

import httpx

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BARE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_request_templates_are_refused_by_default(server) -> None:
    for extra in ({"chat_template": BARE}, {"chat_template_kwargs": {"chat_template": BARE}}):
        response = httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, **extra}, timeout=30)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "chat_template" and "--trust-request-chat-template" in error["message"]
    # other template arguments still pass through
    response = httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {"enable_thinking": False}}, timeout=30)
    assert response.status_code == 200, response.text


def test_a_trusting_server_renders_the_request_template_in_the_sandbox(tools_server) -> None:
    default = httpx.post(f"{tools_server.url}/v1/chat/completions", json=CHAT, timeout=30).json()["usage"]["prompt_tokens"]
    for extra in ({"chat_template": BARE}, {"chat_template_kwargs": {"chat_template": BARE}}):
        response = httpx.post(f"{tools_server.url}/v1/chat/completions", json={**CHAT, **extra}, timeout=30)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens"] < default  # "hi" alone, not the model's template around it
    for hostile in ("{{ cycler.__init__.__globals__.os.popen('id').read() }}", "{% for i in range(10**9) %}x{% endfor %}"):
        response = httpx.post(f"{tools_server.url}/v1/chat/completions", json={**CHAT, "chat_template": hostile}, timeout=30)
        assert response.status_code == 400, response.text
