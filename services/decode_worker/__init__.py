"""The decode worker: pulls KV through Mooncake, decodes with continuous batching, streams tokens."""
