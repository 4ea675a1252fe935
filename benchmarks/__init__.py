"""Benchmark scripts: they print figures (quoted in the README); tests never time anything."""
