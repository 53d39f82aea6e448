"""What an operator runs on a workstation to put the job on a cluster, and what checks the chart.

- ``chart``: ``resilient-fsdp render``: the Helm chart through Helm's engine, values merged as
  ``helm -f/--set`` merges them; the trainer part of ``values.schema.json`` from the config;
- ``validate``: ``resilient-fsdp validate``: lint, the Kubernetes and CRD schemas (the CRDs vendored
  in ``charts/vendor/crds``), the admission rules of each workload kind;
- ``admission``: the rules the JobSet and Trainer webhooks and the Job API enforce beyond any
  schema (name lengths, failure policies, ``podFailurePolicy``, reserved ``PET_*`` variables, ...);
- ``pod_security``: the Pod Security Standards (baseline, restricted) every pod must meet to be
  admitted to a namespace of that level;
- ``chart_scan``: the checkov scan of the rendered chart and its accepted findings;
- ``release_check``: the chart's ``helm test`` check, run in a Pod beside the job: shared volume
  writable by the pods' user, requested GPUs and EFA devices visible, memlock unlimited for EFA,
  rendezvous host resolves;
- ``values_docs``: ``scripts/chart-readme``: the chart's README generated from ``values.yaml``;
- ``image``: ``scripts/build-image``: ``docker build`` with the pins as build arguments, ``--push``;
- ``ecr``: ECR through boto3: registry address, repository, login token;
- ``image_deps``: the image's Python packages, this project's pins over the base image's (also
  run from a lone copy of the file while the image is built);
- ``image_check``: ``scripts/check-image``: the image's build-time and on-node checks.
"""
