"""wordplay: a user's own environment for rayapp, kept outside the rayapp package.

Reverse a word. Its parts are the three a recipe can name by import path:
- ``wordplay:ENV``: the environment (its agent and verifier; its rows come from a file);
- ``wordplay.agent:WordAgent``: the agent, a chat agent that shows the model one worked example;
- ``wordplay.verify:verify``: the verifier, exact match on the last word of the reply.
The rows are ``data/words.jsonl``, mapped onto tasks by the recipe (``rollout.yaml``).
"""

from rayapp import Env
from wordplay.agent import WordAgent
from wordplay.verify import verify

# rows=None: this env has no tasks of its own; each dataset of the recipe reads a file (path + fields)
ENV = Env("reverse", rows=None, make_agent=WordAgent, verify=verify)

__all__ = ["ENV", "WordAgent", "verify"]
