"""The graph: capture of a transformers model, its checks and sharding, and the passes that rewrite it."""
