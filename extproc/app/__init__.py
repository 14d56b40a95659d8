"""The application: the wiring of a request's collaborators (:mod:`.router`) and the plan an
adapter carries out for each request (:mod:`.plan`). Built on the request core; the adapters drive
it."""
