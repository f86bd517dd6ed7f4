"""The attempt's HTTP call to a model server: the keep-alive HTTP/1.1 client (:mod:`.call`),
how a response or error is classified (:mod:`.classify`), the retry backoff
(:mod:`.backoff`) and the tokens a response reports (:mod:`.usage`). Imports nothing of the
pipeline."""
