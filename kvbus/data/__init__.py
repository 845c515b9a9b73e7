"""Data shipped with kvbus (demo prompts)."""
