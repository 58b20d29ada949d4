"""Environments: one module per built-in one (``arithmetic``, ``math``, ``humaneval``, ``swe``), each
with its rows, verifier, agent and DAgger agent behind one ``Env`` (``protocol``); a user's own by
import path (``plugin_import``, docs/plugins.md); the shared agents (``agents``), datasets (``datasets``)
and sandboxes (``sandboxes``)."""
