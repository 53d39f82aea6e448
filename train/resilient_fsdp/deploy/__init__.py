"""What an operator runs on a workstation to put the job on a cluster, and what checks the chart.

- ``chart``: ``resilient-fsdp render``: the Helm chart through Helm's engine, values merged;
- ``values_errors``: Helm's schema and ``fail`` refusals rewritten as one sentence per problem;
- ``validate``: ``resilient-fsdp validate``: lint, Kubernetes and CRD schemas, admission rules;
- ``admission``: the rules the JobSet and Trainer webhooks and the Job API enforce beyond schemas;
- ``pod_security``: the Pod Security Standards (baseline, restricted) every pod must meet;
- ``chart_scan``: the checkov scan of the rendered chart and its accepted findings;
- ``release_check``: the chart's ``helm test`` check, run in a Pod beside the job;
- ``values_docs``: ``scripts/chart-readme``: the chart's README generated from ``values.yaml``;
- ``image``: ``scripts/build-image``: ``docker build`` with the pins as build arguments;
- ``ecr``: ECR through boto3: registry address, repository, login token;
- ``image_deps``: the image's Python packages, this project's pins over the base image's;
- ``image_check``: ``scripts/check-image``: the image's build-time and on-node checks.
"""
