import asyncio

from kvmesh.services.router.main import main

if __name__ == "__main__":
    asyncio.run(main())
