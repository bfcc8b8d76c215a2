"""Compatibility module: `from ravnest.operations.utils import clusterize` as in Ravnest."""

from ..clustering import clusterize

__all__ = ["clusterize"]
