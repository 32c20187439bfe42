from kvmesh.service_main import run_service
from kvmesh.services.router.main import main

if __name__ == "__main__":
    run_service(main(), "kvmesh-router")
