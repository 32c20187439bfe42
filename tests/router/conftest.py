"""Fixtures for the router's HTTP tests: a real tiny tokenizer, a scripted backend, an in-process client."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.services.router.app import create_app
from tests.router.fakes import FakeBackend


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


@pytest.fixture
def fake(tokenizer: Tokenizer) -> FakeBackend:
    return FakeBackend(tokenizer)


@pytest.fixture
def app(fake: FakeBackend) -> FastAPI:
    return create_app(fake)


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        yield c
