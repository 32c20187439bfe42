"""kv-metadata's settings (``KVMetadataSettings``) from flags and ``KVMESH_*`` variables
(``kv_metadata_settings``)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from kvmesh.settings import env
from kvmesh.settings.flags import SettingsParser, from_args
from kvmesh.settings.values import host_address, port_number, positive_number
from kvmesh.settings.mesh import MeshSettings, add_mesh_args, mesh_settings

INGEST_SPAN_INTERVAL = 10.0  # seconds one kv_ingest span sums up (KVMESH_INGEST_SPAN_INTERVAL)


def new_service_id() -> str:
    return f"kv-metadata-{uuid.uuid4().hex[:8]}"


@dataclass(slots=True, frozen=True)
class KVMetadataSettings:
    mesh: MeshSettings
    service_id: str = field(default_factory=new_service_id)
    mirror_interval: float = 0.2  # seconds between batched writes of the etcd mirror
    ingest_span_interval: float = INGEST_SPAN_INTERVAL
    health_host: str = "127.0.0.1"
    health_port: int = 0  # 0: a free port


def kv_metadata_parser() -> SettingsParser:
    parser = SettingsParser(prog="kvmesh-kv-metadata", description="kvmesh kv-metadata service")
    add_mesh_args(parser)
    option = parser.option
    option("--service-id", env=env.SERVICE_ID)
    option("--mirror-interval", env=env.MIRROR_INTERVAL, type=positive_number, default=0.2)
    option(
        "--ingest-span-interval", env=env.INGEST_SPAN_INTERVAL, type=positive_number, default=INGEST_SPAN_INTERVAL,
        help="seconds of event ingestion one kv_ingest span sums up (KVMESH_INGEST_SPAN_INTERVAL)",
    )  # fmt: skip
    option("--health-host", env=env.HEALTH_HOST, type=host_address, default="127.0.0.1")
    option(
        "--health-port", env=env.HEALTH_PORT, type=port_number, default=0,
        help="port of /health/live and /health/ready; 0 picks a free one (KVMESH_HEALTH_PORT)",
    )  # fmt: skip
    return parser


def kv_metadata_settings(argv: list[str] | None = None) -> KVMetadataSettings:
    parser = kv_metadata_parser()
    args = parser.parse_args(argv)
    mesh = mesh_settings(args, parser)
    return from_args(KVMetadataSettings, args, mesh=mesh, service_id=args.service_id or new_service_id())
