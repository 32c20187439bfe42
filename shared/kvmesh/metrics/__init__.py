"""Prometheus metrics in vLLM's vocabulary (``vllm:`` names under a ``kvmesh:`` prefix, same
units and buckets): the contract every service exports (``contract``), the workers'
(``worker``), and what they share (``buckets``, ``render``)."""
