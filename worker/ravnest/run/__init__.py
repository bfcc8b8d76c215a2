"""Run: processes and their supervision.

A worker process assembled from its node metadata (`worker`), the local runner that plans a job
and supervises one worker per provider (`local`), and job progress read from metrics (`progress`).
"""
