"""`kvmesh serve`: an OpenAI-compatible HTTP server whose prompt cache is the whole mesh."""
