"""Running the real servers kvmesh needs (nats-server, etcd) and the service processes."""
