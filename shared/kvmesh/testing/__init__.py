"""Test utilities for kvmesh (kept import-light; import submodules explicitly)."""
