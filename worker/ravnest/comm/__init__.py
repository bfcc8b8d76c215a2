"""Comm: how tensors travel between workers.

Frames of raw tensor bytes with a typed header (`framing`), received into reused buffers
(`buffers`); gRPC peers and servers (`transport`); the inboxes where received frames wait for the
compute thread (`inboxes`); the authenticated TCP data plane for ring pieces (`dataplane`) and the
job's mutual TLS material (`tls`); what a sender must do (`sending`) and a sender within one process
(`loopback`). Knows nothing of models, plans or training.
"""
