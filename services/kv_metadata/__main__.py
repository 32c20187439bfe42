import asyncio

from kvmesh.services.kv_metadata.main import main

if __name__ == "__main__":
    asyncio.run(main())
