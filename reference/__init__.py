"""The real runtime: SeamlessFlow's data plane (trajectory manager, partial rollout).

Layout: `tokenizer` (byte-level BPE built offline, Qwen-style ChatML), `model` (tiny Qwen3 config,
real checkpoints from a local directory, the plain-transformers scorer), `engine/` (the
`InferenceEngine` seam in `base.py`; the built-in continuous-batching engine, the vLLM backend, a
deterministic fake; the HTTP server, client and process launcher that put each engine in its own
process), `manager/` (the trajectory manager: OpenAI-compatible server, chat rendering, per-session
prefix trees, routing, the SQLite store, an embeddable background-thread runner), `consistency`
(re-scoring stored trajectories), `cli` (`python -m reference serve | engine | check |
build-tokenizer`). The GRPO trainer and the runtime's control plane are not built yet.
"""
