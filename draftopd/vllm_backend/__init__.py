"""The vLLM rollout backend: stock vLLM with a recording hook (hook.py) and live drafter updates (engine.py)."""
