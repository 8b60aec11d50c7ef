"""How trainguard reaches the services it stands on: Temporal, S3, the
node pool workflow, an OpenTelemetry collector, and the settings that say where they are.
"""
