"""A router bug met by some input (an exception no handler answers) is a 500 with an OpenAI
error body, counted, and the client's connection stays open (``internal_errors``)."""

from __future__ import annotations

import httpx

from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.services.router.app import create_app
from kvmesh.services.router.limits import Limits
from tests.router.fakes import FakeBackend
from tests.router.served import served

MODEL = "tiny-llama"


class BrokenTokenizer(Tokenizer):
    """Fails on one prompt, as the tokenizer did on a lone surrogate only the template saw."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if "break" in text:
            raise TypeError("TextInputSequence must be str")
        return super().encode(text, add_special_tokens=add_special_tokens)


async def test_an_unanswered_exception_is_a_counted_500_and_the_connection_stays_open(fake: FakeBackend, tokenizer: Tokenizer) -> None:
    fake.tokenizer = BrokenTokenizer(tokenizer.backend, chat_template=tokenizer.chat_template)
    app = create_app(fake)
    limits = Limits()
    async with served(app, limits) as router:
        async with httpx.AsyncClient(base_url=router.url, timeout=10, limits=httpx.Limits(max_connections=1)) as client:
            resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "please break"})
            assert resp.status_code == 500
            assert resp.headers["content-type"] == "application/json"
            error = resp.json()["error"]
            assert error["type"] == "server_error" and "the router failed on this request" in error["message"]
            # the same connection (one in the pool) serves the next request
            resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "fine", "max_tokens": 2})
            assert resp.status_code == 200, resp.text
            metrics = (await client.get("/metrics")).text
    assert 'endpoint="/v1/completions",status="500"' in metrics.replace(", ", ",")
