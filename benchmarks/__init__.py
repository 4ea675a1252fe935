"""Benchmark scripts: they print figures (quoted in docs/); tests never time anything."""
