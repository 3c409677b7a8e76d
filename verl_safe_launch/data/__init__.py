"""Data files generated from verl and its releases: schema, config history, renames, architectures."""
