"""Every service's settings, in one home: built from flags and ``KVMESH_*`` environment
variables by one function each (a flag beats its variable; a bad value is one CLI error
line), dataclasses inside.

- ``env``: the registry of every ``KVMESH_*`` variable and the one reader of them;
- ``flags``: flags backed by a variable (``SettingsParser``);
- ``mesh``: ``MeshSettings``, where the mesh is, which every service has;
- ``worker``: ``WorkerSettings`` and the ``EngineSettings`` an engine is made from;
- ``router``: ``RouterSettings``;
- ``kv_metadata``: ``KVMetadataSettings``.

Only ``env`` and ``mesh`` are imported here: the router's settings import its modules.
"""

from kvmesh.settings.env import REGISTRY, EnvVar, variables
from kvmesh.settings.mesh import MeshSettings

__all__ = ["REGISTRY", "EnvVar", "MeshSettings", "variables"]
