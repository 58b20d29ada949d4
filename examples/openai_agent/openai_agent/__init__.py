"""An agent written against the OpenAI API, run by rayapp through its gateway (README.md beside this
package): ``agent.solve`` is the agent, ``verify.verify`` its verifier. Neither imports rayapp."""
