"""The attempt's HTTP call to a model server: the keep-alive HTTP/1.1 client (:mod:`.call`),
how a response or error is classified (:mod:`.classify`) and the retry backoff
(:mod:`.backoff`). Imports nothing of the pipeline."""
