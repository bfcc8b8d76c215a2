"""Comm: how tensors travel between workers.

Frames of raw tensor bytes with a typed header (`framing`), gRPC peers, servers and inboxes
(`transport`), the authenticated TCP data plane for ring pieces (`dataplane`) and the job's mutual
TLS material (`tls`). Knows nothing of models, plans or training.
"""
