"""SimPy discrete-event model of GRPO post-training on GPU clusters under five scheduling policies.

Layout: `config` (the YAML-backed config), `calibration` (a measured profile's constants, fitted before
any cost model is built), `cost` (the roofline cost model on named terms; `train_layout` the trainer's),
`workload` (math and SWE samples, sandbox starts), `engine` (a continuous-batching inference engine;
`kv_blocks` its paged KV cache), `routing` (the router and queue in front of the engines), `host_load`
(the host's work on the devices' cores), `runner` (the executor that applies a policy's decisions),
`report` and `cli` (outputs and `python -m sim`).
"""
