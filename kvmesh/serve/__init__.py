"""`kvmesh serve`: an OpenAI-compatible HTTP server whose prompt cache is the whole mesh.

Its layers, each importing only those below it: `apis/` (each API's bodies as the neutral `Turn`
of `turns`, and its answers and errors back), `http/` (the Starlette app, its guards, a Turn made
into a job, the job's events to the client), and beneath them the engine (`engine`, `jobs`, `batch`,
`solo`: generation on its own thread) and its prompt cache (`prompt_cache`: memory, store, mesh).
`server` wires them to uvicorn; `options` holds its settings.
"""
