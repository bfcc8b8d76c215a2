"""Compatibility module: `from ravnest.operations.utils import clusterize` as in Ravnest."""

from ravnest.seed.clustering import clusterize

__all__ = ["clusterize"]
