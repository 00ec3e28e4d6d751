"""Routing of requests to data-parallel replicas by cached prefix and load."""
