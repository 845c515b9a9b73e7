"""Integrations of kvbus into serving engines (`kvbus.integrations.vllm`: a vLLM KV connector)."""
