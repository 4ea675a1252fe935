"""The real runtime: SeamlessFlow's data plane (trajectory manager, partial rollout) and control plane.

Layout: `tokenizer` (byte-level BPE built offline, Qwen-style chat template), `model` (tiny Qwen3
config, loading real checkpoints from a local directory), `engine/` (the `InferenceEngine` seam: the
built-in continuous-batching engine, the vLLM backend, a deterministic fake, and the HTTP server and
client that put each engine in its own process), `manager/` (the trajectory manager: an
OpenAI-compatible server with per-session prefix trees and a SQLite store).
"""
