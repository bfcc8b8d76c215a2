"""Train: what one node does with its stage.

The pipeline runtime and its schedules (`runtime`), ring all-reduce across clusters
(`allreducing`), checkpoints (`checkpointing`), fusing stage files into one model (`fusing`),
metrics (`metrics`) and the worker's heap settings (`heap`). Uses `plan` and `comm`; starts no
processes and reads no environment.
"""
