"""Hugging Face interoperation: models defined by a ``config.json``, pretrained weights in, the
trained model out.

- ``names``: the built-in model's parameters under the names of transformers' Llama, and the
  ``config.json`` that describes a preset;
- ``model``: a causal LM built from a ``config.json`` (``model.hf_config``) on the meta
  device, its repeated decoder layers found for FSDP, its weights initialised shard by shard;
- ``weights``: pretrained safetensors loaded into the sharded model (``model.init_from``)
  through torch DCP's Hugging Face reader, each rank reading its own shards;
- ``export``: a committed checkpoint as a safetensors model directory that
  ``transformers.AutoModelForCausalLM.from_pretrained`` loads (``checkpoints export``).

``transformers`` is imported only by ``model``, and only when ``model.hf_config`` is set.
"""
