"""Who may do what on the mesh: credentials files, NATS permissions, etcd roles."""
