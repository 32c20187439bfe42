import asyncio

from kvmesh.services.prefill_worker.main import main

if __name__ == "__main__":
    asyncio.run(main())
