"""The agent gateway: an OpenAI-compatible door per episode, so an agent written against the OpenAI
API runs unchanged as an episode (docs/agents.md). Pure pieces here; the Serve deployment that
serves the routes lives in the Ray shell."""
