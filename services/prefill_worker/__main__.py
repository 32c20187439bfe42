import asyncio
import sys

from kvmesh.services.prefill_worker.main import main

if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
