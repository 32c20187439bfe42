"""The domain's exceptions. Services translate them once, at their edges."""

from __future__ import annotations


class KvmeshError(Exception):
    """Base of every error kvmesh raises on purpose."""


class ModelLoadError(KvmeshError, ValueError):
    """The model, its weights, its tokenizer or the device could not be loaded or used."""


class EngineError(KvmeshError, RuntimeError):
    """The engine cannot serve requests."""


class MeshError(KvmeshError):
    """A request failed in the mesh. ``code`` is one of ``kvmesh.protocol.ErrorInfo``'s codes
    (bad_request, overloaded, unavailable, internal, cancelled)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
