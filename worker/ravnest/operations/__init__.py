"""Compatibility package: Ravnest's `ravnest.operations.utils.clusterize`."""
