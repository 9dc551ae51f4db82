"""Chainlit chat UI for the Phi-3-vision API (`python -m ui`; see ui/README.md)."""
