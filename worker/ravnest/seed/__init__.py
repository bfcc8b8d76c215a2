"""Seed: Ravnest's own Python API (`clusterize`, `Node`, `Trainer`, `set_seed`, `model_fusion`).

Provider scripts written for the original Ravnest run on this layer unchanged; it assembles the same
runtime the worker process uses.
"""
