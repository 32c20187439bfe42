"""A router process over the scripted fake backend, for tests that need a real process (signals).

``python -m tests.router.fake_router --model-dir DIR --tokens N --interval S`` serves
``FakeBackend`` on a free port: every request streams N tokens, one each S seconds. It logs
``fake router listening on http://...`` once serving and ``fake router stopped`` on the way out.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.services.router.app import create_app
from kvmesh.services.router.limits import Limits
from kvmesh.services.router.server import RouterServer, bind, serve
from tests.router.fakes import Emit, FakeBackend, Finish, Sleep

logger = logging.getLogger("fake_router")


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--interval", type=float, default=0.05)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    script = [step for _ in range(args.tokens) for step in (Emit((5,), "tok"), Sleep(args.interval))]
    fake = FakeBackend(Tokenizer.from_dir(args.model_dir), script=[*script, Finish("length")])
    limits = Limits()
    app = create_app(fake, limits=limits)
    try:
        await serve(RouterServer(app, limits), bind("127.0.0.1", 0), on_listening="fake router listening on")
    finally:
        logger.info("fake router stopped: %d cancelled, %d finished", len(fake.cancelled), len(fake.finished))


if __name__ == "__main__":
    asyncio.run(main())
