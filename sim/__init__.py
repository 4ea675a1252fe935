"""SimPy discrete-event model of GRPO post-training on GPU clusters under five scheduling policies.

Layout: `config` (the YAML-backed config), `cost` (roofline cost model), `workload` (math and SWE
samples), `engine` (a continuous-batching inference engine), `runner` (the executor that applies a
policy's decisions), `report` and `cli` (outputs and `python -m sim`).
"""
