"""The attempt's HTTP call to a model server: the client, how its outcome is classified, the
retry backoff and the tokens it reports. Imports nothing of the pipeline but ``redact``."""
