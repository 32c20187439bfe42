import asyncio

from kvmesh.services.decode_worker.main import main

if __name__ == "__main__":
    asyncio.run(main())
