"""The three APIs of `kvmesh serve`, one module each (`openai_api`: chat completions and completions,
`anthropic`: Messages, `responses`: OpenAI's Responses), each with its `Api` object (`api.Api`):
a body made into the neutral `Turn`, an answer written back whole or streamed, and the API's error
body. The HTTP layer (kvmesh.serve.http) runs every Api the same way."""
