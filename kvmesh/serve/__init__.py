"""`kvmesh serve`: an OpenAI-compatible HTTP server whose prompt cache is the whole mesh.

Its layers, each importing only those below it: `http/` (the Starlette app, its guards, a Turn made
into a job, the job's events to the client), `apis/` (each API's body as the neutral `Turn` of
`turns`, and its answers and errors back), the engine (`engine`, `jobs`, `batch`, `solo`: generation
on its own thread) and its prompt cache (`prompt_cache`: memory, store, mesh), and at the bottom
`protocol/` (each API's request body as a typed model, no MLX). `server` wires them to uvicorn;
`options` holds its settings.
"""
