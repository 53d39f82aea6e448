"""Deploying the trainer on Kubernetes: what the Helm chart runs besides the training pods, and
what checks and documents the chart."""
