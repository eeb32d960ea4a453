"""Unknown routes and wrong methods answer in the error format of the API the path belongs to;
/docs is served with its assets from the server itself (no CDN)."""

from __future__ import annotations

import re

import anthropic
import httpx
import openai
import pytest


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/responses", "/v2/anything"])
def test_unknown_openai_paths_get_openai_404s_naming_the_path(server, path: str) -> None:
    response = httpx.post(f"{server.url}{path}", json={"input": "x"})
    error = response.json()["error"]
    assert response.status_code == 404 and path in error["message"] and error["code"] == 404 and "type" in error
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="/v1/embeddings"):
        client.embeddings.create(model="tiny", input="hello")


def test_anthropic_and_kobold_paths_get_their_own_404s(server) -> None:
    response = httpx.post(f"{server.url}/v1/messages/batches", json={})
    assert response.status_code == 404 and response.json()["type"] == "error"
    assert response.json()["error"]["type"] == "not_found_error" and "/v1/messages/batches" in response.json()["error"]["message"]
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.NotFoundError, match="/v1/files"):
        claude.get("/v1/files", cast_to=object)
    kobold = httpx.get(f"{server.url}/api/v1/nothing")
    assert kobold.status_code == 404 and "/api/v1/nothing" in kobold.json()["detail"]["msg"]


def test_wrong_methods_are_405_with_allow(server) -> None:
    response = httpx.get(f"{server.url}/v1/chat/completions")
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert "takes POST" in response.json()["error"]["message"]
    response = httpx.delete(f"{server.url}/v1/messages")
    assert response.status_code == 405 and response.json()["type"] == "error"


def test_docs_load_only_local_assets(server) -> None:
    page = httpx.get(f"{server.url}/docs")
    assert page.status_code == 200 and "swagger" in page.text.lower()
    urls = re.findall(r"""(?:src|href|url)\s*[:=]\s*['"]([^'"]+)['"]""", page.text)
    assert {"/openapi.json", "/docs/assets/swagger-ui-bundle.js", "/docs/assets/swagger-ui.css"} <= set(urls)
    assert all(url.startswith("/") and not url.startswith("//") for url in urls), urls
    assert "http://" not in page.text and "https://" not in page.text.replace("https://swagger.io", "")
    for url in urls:
        asset = httpx.get(f"{server.url}{url}")
        assert asset.status_code == 200 and len(asset.content) > 100, url
    assert "SwaggerUIBundle" in httpx.get(f"{server.url}/docs/assets/swagger-ui-bundle.js").text
