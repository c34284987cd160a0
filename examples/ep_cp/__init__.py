"""Building blocks of the EP + CP distillation example (``examples/train_ep_cp.py``).

One module per job, in the order a batch meets them:

- :mod:`ep_cp.config`     -- the sizes of the frozen target and of the MoE student;
- :mod:`ep_cp.synthetic`  -- the variable-length token dataset, generated in-process;
- :mod:`ep_cp.target`     -- the frozen "target" transformer whose outputs are cached;
- :mod:`ep_cp.jsonl_data` -- or real text: a JSONL file tokenized with a model's tokenizer;
- :mod:`ep_cp.hf_target`  -- or a Hugging Face causal LM from a local directory as target;
- :mod:`ep_cp.supervision` -- a target's outputs -> the cache rows (top-k, padding zeroed);
- :mod:`ep_cp.cache_format` -- what the cache holds; the student's sizes from its manifest;
- :mod:`ep_cp.parallel`   -- torch.distributed + Megatron parallel groups, gradient sync;
- :mod:`ep_cp.moe`        -- top-k router and expert-parallel all-to-all dispatch;
- :mod:`ep_cp.student`    -- the MoE student (THD attention through ``te_thd.attention``);
- :mod:`ep_cp.objective`  -- KL to the cached top-k + hidden-state regression;
- :mod:`ep_cp.checkpoint` -- per-rank, crash-safe checkpoints for ``--resume``;
- :mod:`ep_cp.tiny_hf`    -- a tiny Hugging Face model directory built in-process (tests, try-outs).
"""
