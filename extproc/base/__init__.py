"""The base layer, importing nothing of the router: time and chance injected (:mod:`.world`),
the event loop, logging, sampling, the checks every setting uses (:mod:`.validation`), upstream
timeouts and an engine's speeds as pricing reads them (:mod:`.engine_rates`)."""
