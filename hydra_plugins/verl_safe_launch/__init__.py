"""Hydra plugins of verl-safe-launch: the preset search path and the pre-flight callback."""
