"""The agent gateway: an OpenAI-compatible door per episode, so an agent written against the OpenAI
API runs unchanged as an episode (docs/agents.md). Pure pieces: the request door (``openai_api``),
the keys per episode (``episodes``), each episode's token accounting (``accounting``), tool calls
(``tool_calls``) and the service that answers the routes (``service``); ``routes`` turns its replies
into Starlette responses and gives the FastAPI routes the manager's Serve ingress mounts."""
