{{/*
What the chart's rules (validations.yaml) know of the trainer: its defaults for the keys they
read, the built-in presets' sizes, and the limits both apply. Generated from resilient_fsdp
(python -m resilient_fsdp.deploy.chart --update-schema); a test keeps it current.
*/}}
{{- define "resilient-fsdp.trainerFacts" -}}
{"defaults": {"data.factory": null, "data.path": null, "data.seq_len": 64, "data.source": "synthetic", "dist.device": "auto", "dist.init_timeout_s": 600.0, "dist.shard_group_size": 0, "dist.timeout_s": 300.0, "model.factory": null, "model.max_seq_len": null, "model.preset": "tiny", "model.vocab_size": null}, "dump_margin_s": 60.0, "max_state_percent": 75, "presets": {"125m": {"dim": 768, "params_besides_embeddings": 84953856, "vocab_size": 32000}, "1b": {"dim": 2048, "params_besides_embeddings": 968976384, "vocab_size": 32000}, "70b": {"dim": 8192, "params_besides_embeddings": 68452360192, "vocab_size": 128256}, "8b": {"dim": 4096, "params_besides_embeddings": 6979588096, "vocab_size": 128256}, "tiny": {"dim": 64, "params_besides_embeddings": 98624, "vocab_size": 256}}, "training_bytes_per_param": 16}
{{- end }}
