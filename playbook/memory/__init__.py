"""Memory mechanisms applied to a model: selective and offloaded activation checkpointing, the MLP in token
chunks."""
