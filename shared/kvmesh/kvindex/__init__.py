"""The in-memory index of the cluster KV cache (the core of the kv-metadata service).

``KVIndex`` maps block hashes to the workers (and tiers) holding them and answers prefix
matches over chains of hashes; ``EventSequencer`` orders each worker's event batches.
"""

from kvmesh.kvindex.events import EventSequencer, Gap, Verdict
from kvmesh.kvindex.index import DEFAULT_TIER, KVIndex

__all__ = ["DEFAULT_TIER", "EventSequencer", "Gap", "KVIndex", "Verdict"]
