"""Cluster state in etcd: worker registration under leases, the live worker directory, pins."""
