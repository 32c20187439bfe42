"""kvmesh's services, one folder each; imported as ``kvmesh.services.<name>``."""
