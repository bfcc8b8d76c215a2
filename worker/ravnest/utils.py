"""Compatibility module: Ravnest's `ravnest.utils` (`model_fusion`, `set_seed`)."""

from ravnest.seed.fusion import model_fusion, set_seed

__all__ = ["model_fusion", "set_seed"]
