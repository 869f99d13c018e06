"""The request bodies of `kvmesh serve`'s APIs as typed models (pydantic, as vLLM's entrypoints keep
them): `openai` (chat completions, completions), `anthropic` (Messages) and `responses`.

Each model declares every top-level field its API defines that this server reads, with its type and
bounds (numbers, counts, lengths), so that a wrong value is refused by name before anything else
reads it; any other key is kept, and the response names it in `x-kvmesh-ignored` (`Body.unknown`).
What each field does is the business of the API's translator (kvmesh.serve.apis). Nothing here
imports MLX, so the protocol can be read and tested without it (tests/unit/test_layers.py).
"""
