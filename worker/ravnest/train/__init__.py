"""Train: what one node does with its stage.

The node's training loop (`runtime`), a coordinator of: the stage's forward and backward passes
(`pipelining`), the sync and async schedules with weight stashing (`schedules`), the optimizer
with its scheduler, clipping and accumulation (`optimizing`), the frames' kinds and control
operations (`messages`), validation (`validating`) and the learning curve (`curves`), what its
rings average (`averaging`) and the ring all-reduce itself (`allreducing`), and its checkpoints
(`resuming`, on `checkpointing`'s files). Also fusing stage files into one model (`fusing`),
metrics (`metrics`) and the worker's heap settings (`heap`). Uses `plan` and `comm`; starts no
processes and reads no environment.
"""
