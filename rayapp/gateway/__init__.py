"""The agent gateway: an OpenAI-compatible door per episode, so an agent written against the OpenAI
API runs unchanged as an episode (docs/agents.md). Pure pieces here: the request door
(``openai_api``), the keys per episode (``episodes``) and each episode's token accounting
(``accounting``); the Serve deployment that serves the routes lives in the Ray shell."""
