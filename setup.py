"""Package layout: shared/kvmesh is ``kvmesh``, services/<name> is ``kvmesh.services.<name>``.

The metadata lives in pyproject.toml; this file only maps the two source roots.
"""

from setuptools import find_packages, setup

packages = ["kvmesh", *(f"kvmesh.{name}" for name in find_packages("shared/kvmesh"))]
packages += ["kvmesh.services", *(f"kvmesh.services.{name}" for name in find_packages("services"))]

setup(
    packages=packages,
    package_dir={"kvmesh": "shared/kvmesh", "kvmesh.services": "services"},
    package_data={"kvmesh.transfer": ["bind_guard.c"]},  # built at first use (kvmesh.transfer.bind_guard)
)
