"""Run: processes and their supervision.

The node metadata every writer and reader of it shares (`metadata`), the one path from metadata to
a node that trains (`assembling`, also the seed API's), a worker process assembled from its node
metadata (`worker`), the local runner that plans a job and supervises one worker per provider
(`local`), the rules of elastic training both supervisors follow (`elastic`: the runner's and the
operator's), and job progress read from metrics (`progress`).
"""
