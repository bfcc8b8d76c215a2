"""Plan: from a job spec and its model to a deterministic plan.

The model is traced into layers and measured (`partitioning`), providers are grouped into clusters
and each cluster's layers are split into stages under memory limits (`planning`), by a cost model
of time and memory (`costs`), into a `Plan` that every other part reads (`plans`); a job spec is
turned into live objects and a plan (`building`). Nothing here talks to the network.
"""
