"""`kvmesh serve`'s HTTP layer: the Starlette app and its one generic handler (`app`), what a request
must pass before any work is done (`guards`), a Turn made into the engine's job (`turn_jobs`), and
the job's events carried back to the client (`pump`). What each API's bodies and answers look like
is `kvmesh.serve.apis`'s."""
