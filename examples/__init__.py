"""Recipes to adapt (examples/README.md); a package so that `examples.reverse_task:ReverseTask` imports."""
