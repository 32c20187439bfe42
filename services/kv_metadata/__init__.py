"""kv-metadata: the cluster index of which worker holds which KV block."""
